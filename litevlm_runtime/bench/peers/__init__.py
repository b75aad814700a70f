"""The engines a user would run instead, on the same weights, in one run (`litevlm bench --peers`).

Writing the peers' files is apart from timing them:

  models.py         the weights: a preset's random checkpoint in OpenGVLab's layout, and the "peer
                    form" of a model folder (the same function in the layout the peers' converters read)
  files.py          llama.cpp's files by its own converter and quantizer, cached by the weights' digest
  openvino_rows.py  OpenVINO's files (optimum-intel's exports, the vision IR) and its rows
  convert_gguf.py   (standalone) llama.cpp's convert_hf_to_gguf.py / llama_model_quantize

and the timing, each row in its own process:

  run_project.py    this project's rows (python -m, the package's own defaults)
  run_llama_cpp.py  (standalone) llama.cpp: libmtmd whole questions, or the decode step
  run_openvino.py   (standalone, the OpenVINO venv) optimum's export attempt, OpenVINO GenAI rows
  whole.py          whole six-camera questions: rows, rounds, the table, the PNG
  decode.py         the decode-step table, with a --hog column
  command.py        the flags of `litevlm bench --peers [--whole]`
  flags.py          the flag values and the machine line (command.py, decode.py)
  env.py            where the peers live; the clean environment their processes start with
"""
