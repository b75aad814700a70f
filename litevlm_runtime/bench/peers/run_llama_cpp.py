"""One llama.cpp row, run as a standalone script in its own process: whole questions with images
through libmtmd (llama.cpp's multimodal library, llama-cpp-python's `mtmd_cpp` bindings), or the
decode step of the language model alone.

    python run_llama_cpp.py JOB.json OUT.json

Standalone on purpose: it imports neither litevlm_runtime nor torch, so nothing of this project
(its OMP_WAIT_POLICY, its thread settings) reaches llama.cpp's OpenMP runtime; the parent starts it
with an environment stripped of OMP_*/KMP_*/MKL_*/GOMP_* (peers/env.py) and llama.cpp runs at its
own defaults (llama_context_default_params / mtmd_context_params_default: n_batch 2048, n_ubatch
512, flash attention auto, F16 KV cache), with only the thread count set. The peers' packages
(llama_cpp, gguf, numpy, PIL: `scripts/setup.sh --peers`) are imported where a mode uses them.

A whole question, as llama.cpp's own `llama-mtmd-cli` runs one, from the camera images' encoded
bytes (the same files every engine reads) to bitmaps, one of two ways (job "preprocess"):

  tile   (default) each JPEG decoded and resized to the tile by PIL, bicubic, as upstream
         InternVL's preprocessing makes its one tile (`dynamic_preprocess(max_num=1)`: the whole
         frame, no thumbnail), handed over as RGB (`mtmd_bitmap_init`): mtmd then uses it as is
         (an image no larger than the tile is not resized or sliced): one tile per camera, as
         every engine here.
  mtmd   `mtmd_helper_bitmap_init_from_buf` (stb_image decodes the JPEG) and mtmd's own InternVL
         preprocessing, which for an image larger than the tile adds the overview to the slices
         even when the grid is one tile (max_dynamic_patch 1): 2 tiles per camera, the same
         resized frame twice, twice the visual tokens. What a user of llama-mtmd-cli gets.

then `mtmd_tokenize` over the prompt text with one media marker per camera (`<img>`..`</img>`
around each image) -> per chunk: text decoded (`mtmd_helper_eval_chunk_single`), an image encoded
(`mtmd_encode_chunk`: the vision stage) and its embeddings decoded
(`mtmd_helper_decode_image_chunk`: prefill) -> greedy argmax of the last logits -> one
`llama_decode` per new token, exactly `new_tokens` of them (the reference answer's length: the
same work for every engine; end-of-sequence is not special here).

Timings per question (ms): preprocess (bitmaps + tokenize), vision, prefill, ttft (from the bytes
to the first token), decode per token, total. The first question is run once untimed first
(warm-up). The row's settings and what it checked about its own environment go into OUT.
"""

from __future__ import annotations

import ctypes
import io
import json
import sys
import time

from child_common import environment_check, peak_rss_gb  # this folder: the script runs by path


class Engine:
    def __init__(self, model: str, mmproj: str | None, threads: int, n_ctx: int):
        import llama_cpp

        self.ll = llama_cpp
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        t0 = time.perf_counter()
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.settings = {"n_ctx": n_ctx, "n_batch": cparams.n_batch, "n_ubatch": cparams.n_ubatch,
                         "n_threads": threads, "flash_attn_type": int(cparams.flash_attn_type),
                         "type_k": int(cparams.type_k), "type_v": int(cparams.type_v)}
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.mtmd = None
        if mmproj:
            from llama_cpp import mtmd_cpp

            self.mt = mtmd_cpp
            params = mtmd_cpp.mtmd_context_params_default()
            params.use_gpu = False
            params.n_threads = threads
            params.print_timings = False
            self.mtmd = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), self.model, params)
            if not self.mtmd:
                raise SystemExit(f"libmtmd could not load {mmproj}")
            self.marker = mtmd_cpp.mtmd_default_marker().decode()
            self.settings["mtmd_warmup"] = bool(params.warmup)
            # mtmd_helper_decode_image_chunk (decode embeddings already encoded) is exported by
            # libmtmd but has no binding in llama-cpp-python 0.3.36: declared here.
            fn = mtmd_cpp._libmtmd.mtmd_helper_decode_image_chunk
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float),
                           ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                           ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int32
            self.decode_image = fn
        self.load_s = time.perf_counter() - t0

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def argmax(self) -> int:
        import numpy as np

        logits = self.ll.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def step(self, token: int) -> int:
        arr = (self.ll.llama_token * 1)(token)
        if self.ll.llama_decode(self.ctx, self.ll.llama_batch_get_one(arr, 1)) != 0:
            raise RuntimeError("llama_decode failed")
        return self.argmax()

    def decode_ids(self, ids: list[int]) -> int:
        """A prompt of ids in batches of n_batch (positions continue from the cache) -> the greedy id."""
        for start in range(0, len(ids), self.n_batch):
            part = ids[start:start + self.n_batch]
            arr = (self.ll.llama_token * len(part))(*part)
            if self.ll.llama_decode(self.ctx, self.ll.llama_batch_get_one(arr, len(part))) != 0:
                raise RuntimeError("llama_decode failed on the prompt")
        return self.argmax()

    # ------------------------------------------------------------------ a whole question
    def bitmap(self, data: bytes, tile: int | None):
        """One camera's bitmap: PIL's bicubic tile (tile set), or mtmd's own decoding (None)."""
        mt = self.mt
        if tile:
            from PIL import Image

            raw = Image.open(io.BytesIO(data)).convert("RGB").resize((tile, tile), Image.BICUBIC).tobytes()
            bmp = mt.mtmd_bitmap_init(tile, tile, (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw))
        else:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bmp = mt.mtmd_helper_bitmap_init_from_buf(self.mtmd, buf, len(data), False)
        if not bmp:
            raise RuntimeError("libmtmd could not take an image")
        return bmp

    def question(self, prompt: str, images: list[bytes], new_tokens: int, tile: int | None) -> dict:
        mt = self.mt
        self.clear()
        t0 = time.perf_counter()
        bitmaps = [self.bitmap(data, tile) for data in images]
        text = prompt.replace("<image>", self.marker).encode()
        inp = mt.mtmd_input_text(text, len(text), False, True)
        chunks = mt.mtmd_input_chunks_init()
        arr = (mt.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        rc = mt.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(inp), arr, len(bitmaps))
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc}")
        t_pre = time.perf_counter()
        n_past, seq, image_tokens, vision, prefill = self.eval_chunks(chunks)
        ids = [self.argmax()]
        ttft = time.perf_counter() - t0
        steps = []
        while len(ids) < new_tokens:
            s = time.perf_counter()
            ids.append(self.step(ids[-1]))
            steps.append(time.perf_counter() - s)
        total = time.perf_counter() - t0
        mt.mtmd_input_chunks_free(chunks)
        for bmp in bitmaps:
            mt.mtmd_bitmap_free(bmp)
        return {"ids": ids, "ttft_ms": ttft * 1e3, "total_ms": total * 1e3, "preprocess_ms": (t_pre - t0) * 1e3,
                "vision_ms": vision * 1e3, "prefill_ms": prefill * 1e3,
                "decode_ms_per_token": sum(steps) / len(steps) * 1e3 if steps else None,
                "prompt_positions": n_past, "image_tokens": image_tokens, "prompt_seq": seq}

    def eval_chunks(self, chunks) -> tuple[int, list[int], list[int], float, float]:
        """The tokenized prompt's chunks in order: text decoded, an image encoded (vision) and its
        embeddings decoded (prefill): (positions, the prompt as ids with -1 per image position (for
        the id check), tokens per image, vision seconds, prefill seconds)."""
        mt = self.mt
        vision = prefill = 0.0
        n_past = 0
        seq = []
        image_tokens = []
        n = mt.mtmd_input_chunks_size(chunks)
        for i in range(n):
            chunk = mt.mtmd_input_chunks_get(chunks, i)
            kind = mt.mtmd_input_chunk_get_type(chunk)
            new_past = ctypes.c_int32(n_past)
            if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t(0)
                toks = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                seq.extend(int(toks[j]) for j in range(count.value))
                s = time.perf_counter()
                rc = mt.mtmd_helper_eval_chunk_single(self.mtmd, self.ctx, chunk, n_past, 0, self.n_batch,
                                                      i == n - 1, ctypes.byref(new_past))
                prefill += time.perf_counter() - s
            else:
                s = time.perf_counter()
                rc = mt.mtmd_encode_chunk(self.mtmd, chunk)
                vision += time.perf_counter() - s
                if rc != 0:
                    raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
                ntok = mt.mtmd_input_chunk_get_n_tokens(chunk)
                image_tokens.append(int(ntok))
                seq.extend([-1] * ntok)
                embd = mt.mtmd_get_output_embd(self.mtmd)
                s = time.perf_counter()
                rc = self.decode_image(self.mtmd, self.ctx, chunk, ctypes.cast(embd, ctypes.POINTER(ctypes.c_float)),
                                       n_past, 0, self.n_batch, ctypes.byref(new_past), None, None)
                prefill += time.perf_counter() - s
            if rc != 0:
                raise RuntimeError(f"evaluating chunk {i} returned {rc}")
            n_past = new_past.value
        return n_past, seq, image_tokens, vision, prefill

    # ------------------------------------------------------------------ the decode step alone
    def decode_run(self, prompt: list[int], tokens: int, forced: list[int] | None) -> dict:
        """Prompt ids in one go (prefill), then `tokens` greedy steps, each fed the row's own choice
        or, with `forced`, the reference's (teacher forcing: every step compared on the same
        inputs). A warm-up of the prompt and two steps first."""
        self.clear()
        token = self.decode_ids(prompt)
        for _ in range(2):
            token = self.step(token)
        self.clear()
        t0 = time.perf_counter()
        ids = [self.decode_ids(prompt)]
        prefill = time.perf_counter() - t0
        steps = []
        for _ in range(tokens):
            feed = forced[len(ids) - 1] if forced else ids[-1]
            s = time.perf_counter()
            ids.append(self.step(feed))
            steps.append((time.perf_counter() - s) * 1e3)
        return {"ids": ids, "prefill_s": prefill, "step_ms": steps, "decode_ms": sum(steps) / len(steps)}


def weight_bytes(path: str) -> int:
    """Bytes of the tensors a decode step reads (every tensor of the file: the tied head is the
    embedding table, read whole by the head), from the GGUF header."""
    try:
        import gguf
    except ImportError:
        return 0
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def main(job_path: str, out_path: str) -> int:
    job = json.loads(open(job_path).read())
    engine = Engine(job["model"], job.get("mmproj"), job["threads"], job["n_ctx"])
    env = environment_check()
    out = {"settings": dict(engine.settings, threads=job["threads"]), "load_s": engine.load_s, "environment": env,
           "questions": []}
    if job["mode"] == "whole":
        questions = job["questions"]
        images = {p: open(p, "rb").read() for q in questions for p in q["images"]}
        first = questions[0]
        print(f"llama.cpp: warm-up on question {first['id']}", file=sys.stderr, flush=True)
        tile = job["tile"] if job.get("preprocess", "tile") == "tile" else None
        out["settings"]["preprocess"] = f"PIL bicubic {tile} px tile" if tile else "mtmd's own (tile + overview)"
        engine.question(first["prompt"], [images[p] for p in first["images"]], min(2, first["new_tokens"]), tile)
        for i, q in enumerate(questions):
            res = engine.question(q["prompt"], [images[p] for p in q["images"]], q["new_tokens"], tile)
            res["id"] = q["id"]
            res["vision_tiles"] = len(res["image_tokens"])
            out["questions"].append(res)
            print(f"llama.cpp: question {i + 1}/{len(questions)} ttft {res['ttft_ms'] / 1e3:.1f} s "
                  f"total {res['total_ms'] / 1e3:.1f} s", file=sys.stderr, flush=True)
    else:
        out["decode"] = engine.decode_run(job["prompt"], job["tokens"], job.get("forced"))
        out["weight_bytes"] = weight_bytes(job["model"])
    out["peak_rss_gb"] = peak_rss_gb()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
