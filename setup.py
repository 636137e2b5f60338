"""Ships the GraceAdam C++ sources inside the package, so that a wheel (`pip install .`,
`pip install git+...`) can build the host Adam kernel: they live at the repository root in
csrc/grace_adam/, and the build copies them to superoffload_hf/_csrc/grace_adam/, where
superoffload_hf.host.kernel looks first. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc" / "grace_adam"
SHIPPED = ("*.cpp", "*.h")


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads csrc/ in the checkout
        target = Path(self.build_lib) / "superoffload_hf" / "_csrc" / "grace_adam"
        target.mkdir(parents=True, exist_ok=True)
        for pattern in SHIPPED:
            for source in sorted(CSRC.glob(pattern)):
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithSources})
