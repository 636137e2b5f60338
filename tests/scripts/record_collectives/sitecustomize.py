"""Imported at the start of every Python process whose PYTHONPATH holds this folder (the launches
of tests/dp/test_dp_trainer.py): in a rank (RANK set by torchrun) with SUPEROFFLOAD_RECORD_COLLECTIVES
naming a folder, records the collectives the process issues (superoffload_hf.testing.collective_order)
and writes them there at exit, as rank<RANK>.pkl, for the test to compare across ranks."""

import os

if os.environ.get("SUPEROFFLOAD_RECORD_COLLECTIVES") and "RANK" in os.environ:
    import atexit
    import pickle
    from pathlib import Path

    from superoffload_hf.testing import collective_order

    _recorder = collective_order.install()

    def _write(recorder=_recorder, path=Path(os.environ["SUPEROFFLOAD_RECORD_COLLECTIVES"],
                                              f"rank{os.environ['RANK']}.pkl")) -> None:
        # atexit runs before the interpreter's finalization (where a gloo rank may abort)
        path.write_bytes(pickle.dumps([tuple(e) for e in recorder.events]))

    atexit.register(_write)
