"""The query path: the context built once (runtime), the memory arena, the pipeline that answers one
query top to bottom (pipeline.Pipeline.answer) and its Answer."""
