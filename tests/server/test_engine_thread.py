"""EngineThread: rank 0's torch work (load, then every step) runs on one thread, in order, errors reach the caller."""

import threading

import pytest

from server.engine.thread import EngineThread
from server.llm import LLM
from server.engine.sampler import SamplingParams
from server.engine.request import Sequence
from server.engine.detokenizer import IncrementalDetokenizer


def test_jobs_run_in_order_on_one_other_thread():
    t = EngineThread()
    try:
        seen = []
        futures = [t.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
        for f in futures:
            f.result(timeout=10)
        assert [i for i, _ in seen] == list(range(20))
        idents = {ident for _, ident in seen}
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert t.call(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="bad checkpoint"):
            t.call(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
        with pytest.raises(SystemExit):  # a rank > 0 under torchrun leaves through sys.exit in the launcher
            t.call(lambda: (_ for _ in ()).throw(SystemExit(0)))
        assert t.call(lambda: "still serving") == "still serving"
    finally:
        t.close()


def test_engine_steps_on_the_thread_that_loaded_the_model(checkpoints):
    t = EngineThread()
    llm = t.call(LLM, str(checkpoints("llama")))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = llm.tokenizer.encode("The capital of France")
        ref = t.call(llm.generate, [prompt], params)[0].token_ids
        done = threading.Event()
        seq = Sequence(prompt, params, IncrementalDetokenizer(llm.tokenizer, prompt, params.stop, True),
                       emit=lambda s, text, finished: finished and done.set())
        llm.engine.start(t)
        llm.engine.add(seq)
        assert done.wait(60), "the engine loop did not finish the sequence"
        assert seq.output_ids == ref and len(ref) == 6
        assert llm.engine.loop_thread_id == llm.executor.thread_id != threading.get_ident()
    finally:
        llm.engine.stop()
        llm.close()
        t.close()
