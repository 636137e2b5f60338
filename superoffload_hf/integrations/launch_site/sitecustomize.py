"""Run by Python at start-up in the processes `superoffload launch` starts (this directory is
first on their PYTHONPATH). It arms `superoffload_hf.integrations.autopatch`, then runs the
`sitecustomize` this file shadows, if there is one, so an existing site customization still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _import_autopatch():
    try:
        from superoffload_hf.integrations import autopatch
    except ImportError:
        # Not installed: the package that holds this file is three levels up.
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from superoffload_hf.integrations import autopatch
    return autopatch


def _run_shadowed_sitecustomize():
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _import_autopatch().install_from_environment()
except Exception as error:  # site.py would print one line and carry on without superoffload
    sys.stderr.write(f"superoffload launch: cannot install the Trainer hook: {error!r}\n")
    raise SystemExit(1)
_run_shadowed_sitecustomize()
