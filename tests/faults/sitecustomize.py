"""A machine failure, for tests: Python imports this ``sitecustomize`` at the start of every process
whose PYTHONPATH names this folder (tests/training/test_preemption.py puts it there for torchrun's workers).

With ``BERTFORGE_TEST_FAIL_AT=RANK:STEP`` the worker of that rank exits hard right after its
optimizer step STEP (1-based), on a job's first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT 0), with no chance to save or release anything.
"""

import os

_fault = os.environ.get("BERTFORGE_TEST_FAIL_AT", "")
if _fault and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and "RANK" in os.environ:
    _rank, _step = (int(part) for part in _fault.split(":"))
    if int(os.environ["RANK"]) == _rank:
        from bertforge.training.engine import Engine

        _step_of = Engine.step

        def _failing_step(self, micro_batches, accumulation, step=0):
            out = _step_of(self, micro_batches, accumulation, step)
            if step + 1 == _step:
                os._exit(1)
            return out

        Engine.step = _failing_step
