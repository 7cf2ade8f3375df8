"""The build step pyproject.toml cannot declare: SPEC.md, the rules the suite reads at run time
(conformance/spec.py), is copied into the wheel's ``conformance/`` from the one SPEC.md at the repository root.
The checkout keeps a single copy; conformance/spec.py reads the package's copy when there is one, else the root's."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class build_py_with_spec(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):  # an editable install reads the checkout's SPEC.md
            target = os.path.join(self.build_lib, "conformance", "SPEC.md")
            self.mkpath(os.path.dirname(target))
            self.copy_file(os.path.join(ROOT, "SPEC.md"), target, preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, "conformance", "SPEC.md"))
        return outputs


setup(cmdclass={"build_py": build_py_with_spec})
