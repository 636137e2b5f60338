"""Ships the GraceAdam C++ sources inside the package, so that a wheel (`pip install .`,
`pip install git+...`) can build the host Adam kernel: they live at the repository root in
csrc/grace_adam/, and the build copies them to superoffload_hf/_csrc/grace_adam/, where
superoffload_hf.host.kernel looks first. The recipes (recipes/*.yaml, recipes/accelerate/*.yaml,
recipes/models/*/config.json)
are copied the same way to superoffload_hf/_recipes/ (superoffload_hf.train.catalog), so that
`superoffload train tiny_llama_cpu` works anywhere. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc" / "grace_adam"
SHIPPED = ("*.cpp", "*.h")
RECIPES = Path(__file__).resolve().parent / "recipes"
SHIPPED_RECIPES = ("*.yaml", "accelerate/*.yaml", "models/*/config.json")  # models: the dry run's configs


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
        recipes = Path(self.build_lib) / "superoffload_hf" / "_recipes"
        for pattern in SHIPPED_RECIPES:
            for source in sorted(RECIPES.glob(pattern)):
                (recipes / source.relative_to(RECIPES)).parent.mkdir(parents=True, exist_ok=True)
                self.copy_file(str(source), str(recipes / source.relative_to(RECIPES)))


setup(cmdclass={"build_py": BuildPyWithSources})
