"""The stages of one query before decoding: view selection, preprocessing, the prompt, visual
feature reuse, token selection (and FastV, its baseline), latency budgets."""
