"""The staged pipeline end to end on the tiny checkpoint: answers, stage reports, bad input,
and the memory arena's stability over 100 answers."""

import resource

import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.answer import STAGES
from litevlm_runtime.pipeline.pipeline import Pipeline, prompt_ids


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return Pipeline.from_pretrained(tiny_model, options(max_new_tokens=12))


def test_answer_reports_every_stage(pipe):
    ans = pipe.answer(random_frames(1), "Is there a pedestrian behind the ego car?")
    assert list(ans.stage_ms) == list(STAGES)
    assert all(ms >= 0 for ms in ans.stage_ms.values()) and ans.total_ms > 0
    assert ans.cameras == list(CAMERAS)
    assert ans.visual_tokens == ans.kept_tokens == 6 * pipe.rt.cfg.tokens_per_tile
    assert ans.pipeline == "baseline"            # the tiny model folder carries no LiteVLM modules
    ids, spans = prompt_ids(pipe.rt, list(CAMERAS), ans.question)
    assert ans.input_tokens == len(ids) and len(spans) == 6
    assert 1 <= len(ans.token_ids) <= 12
    assert ans.decode_steps == len(ans.token_ids) - 1 or ans.decode_steps == len(ans.token_ids)
    d = ans.to_dict()
    assert d["total_ms"] == pytest.approx(sum(d["stage_ms"].values()))


def test_two_tiles_per_camera(tiny_model):
    p = Pipeline.from_pretrained(tiny_model, options(tiles_per_camera=2, max_new_tokens=4))
    ans = p.answer(random_frames(2), "What is ahead?")
    assert ans.visual_tokens == 12 * p.rt.cfg.tokens_per_tile


def test_incremental_decode_equals_full_recompute(pipe):
    """Every token the static-cache decoder produced is the argmax of a fresh forward pass over the
    whole prompt + answer so far (no cache reuse), so cache writes, slots and masks are right."""
    frames = random_frames(3)
    ans = pipe.answer(frames, "How many cars are in front?")
    rt = pipe.rt
    n = ans.input_tokens
    lm = rt.lm
    with torch.inference_mode():
        embeds_prompt = rt.arena.embeds[:n].clone()       # prompt embeddings (visual spliced) of this answer
        seq = list(ans.token_ids)
        for t in range(len(seq)):
            extra = lm.embed(torch.tensor(seq[:t], dtype=torch.long))
            x = torch.cat([embeds_prompt, extra])
            m = x.shape[0]
            h, _, _ = lm(x, torch.arange(m), torch.ones(m, m, dtype=torch.bool).tril())
            assert int(lm.head(h[-1:]).argmax(-1)) == seq[t], f"token {t} differs"


@pytest.mark.parametrize("question, msg", [
    ("", "empty question"),
    ("   ", "empty question"),
    ("\u200b\u200b \u2060", "empty question"),
    ("what about <IMG_CONTEXT> here", "reserved token"),
    ("car " * 400, "question too long"),
])
def test_bad_questions(pipe, question, msg):
    with pytest.raises(InputError, match=msg):
        pipe.answer(random_frames(0), question)


def test_missing_camera_and_bad_image_then_serving_resumes(pipe):
    frames = random_frames(0)
    del frames["CAM_BACK_RIGHT"]
    with pytest.raises(InputError, match="CAM_BACK_RIGHT"):
        pipe.answer(frames, "What is behind?")
    frames = random_frames(0)
    frames["CAM_FRONT"] = b"\xff\xd8 broken jpeg"
    with pytest.raises(InputError, match="CAM_FRONT: cannot decode"):
        pipe.answer(frames, "What is ahead?")
    assert pipe.answer(random_frames(0), "What is ahead?").text is not None


def test_deterministic_answers(pipe):
    a = pipe.answer(random_frames(5), "Is the traffic light red?")
    b = pipe.answer(random_frames(5), "Is the traffic light red?")
    assert a.token_ids == b.token_ids


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_arena_is_stable_over_100_answers(pipe):
    """After warm-up, answers allocate no new arena memory (same storage pointers, same sizes)
    and the process's resident memory does not grow."""
    frames = [random_frames(s) for s in range(4)]
    questions = ["What is ahead?", "Is there a bus behind the ego car?", "What should the ego vehicle do?",
                 "How many pedestrians are on the front left?"]
    for i in range(10):                       # warm-up: allocator pools, caches, lazy inits
        pipe.answer(frames[i % 4], questions[i % 4])
    before = {
        k: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for k, t in pipe.rt.arena.buffers().items()
    }
    rss_before = rss_kib()
    for i in range(100):
        pipe.answer(frames[i % 4], questions[(i // 4) % 4])
    after = {
        k: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for k, t in pipe.rt.arena.buffers().items()
    }
    assert after == before
    growth = rss_kib() - rss_before
    assert growth < 8 * 1024, f"resident memory grew by {growth} KiB over 100 answers"


def test_drivelm_frames_answer(pipe, drivelm_dir):
    from litevlm_runtime.frames import read_frame_set

    ans = pipe.answer(read_frame_set(drivelm_dir, 0), "What are the important objects in the current scene?")
    assert ans.stage_ms["preprocess"] > 0 and ans.token_ids
