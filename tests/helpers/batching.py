"""The in-process batching driver the batching tests share (test_batching.py on the torch
backend, test_batching_backends.py on the bound ones), and the bundled pipeline with four KV
regions and two frame sets that test_batching.py and test_follow_up.py serve (module fixtures:
`from helpers.batching import frames, pipe`)."""

import pytest

from helpers import options, random_frames
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_batch=4))


@pytest.fixture(scope="module")
def frames():
    return [random_frames(s, 270, 480) for s in (1, 2)]


def serve(pipe, frames, arrivals, max_new=None):
    """arrivals: (decode pass at which the query arrives, frame set, question); a query waits
    while the batch is full. The clock is decode passes: batched steps, and the passes of a
    query decoding alone (each asks `waiting()` once). Returns {(frame set, question): Answer}
    and the most queries decoded together."""
    batch = BatchDecoder(pipe)
    pending = sorted(arrivals, key=lambda a: a[0])
    answers, clock, widest = {}, [0], 0

    def due():
        return bool(pending) and pending[0][0] <= clock[0] and batch.has_room

    def waiting():
        clock[0] += 1
        return due()

    while pending or len(batch):
        while due():
            _, i, q = pending.pop(0)
            batch.admit(
                frames[i],
                QueryRequest(q, max_new_tokens=max_new or 0),
                frame_keys={c: i for c in frames[i]},
                tag=(i, q),
            )
        widest = max(widest, len(batch))
        for r, ans in batch.step(waiting=waiting):
            answers[r.tag] = ans
        clock[0] += 1
    return answers, widest
