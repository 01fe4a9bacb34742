"""Training frameworks that pick their device themselves, told about rgpu.

With rgpu imported, `torch.accelerator.current_accelerator()` is rgpu (on a machine without
CUDA), as it is cuda on a CUDA machine, and frameworks that ask it train there:

* **Hugging Face accelerate** asks `torch.accelerator`: `Accelerator()` places models and
  batches on rgpu as it is; `Accelerator(cpu=True)` keeps them on the CPU.
* **Hugging Face transformers**' `TrainingArguments` falls back to accelerate's own device
  setting, `ACCELERATE_TORCH_DEVICE`, when no device it knows by name is there, and to "cpu"
  without it, while accelerate, which `Trainer` prepares the model with, chose rgpu: the two
  disagreed. So while `TrainingArguments` works out its device without `use_cpu`, the setting
  says rgpu (and only then: set for good, it would also override `use_cpu`, which accelerate
  gives way to it). A user's own `ACCELERATE_TORCH_DEVICE` is left as it is.

Each patch is applied when its module is imported (or at once if it was), and does nothing to
a release that lacks what it patches.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys

import torch


def _rgpu_is_the_accelerator():
    device = torch.accelerator.current_accelerator()
    return device is not None and device.type == "rgpu"


def _patch_training_arguments(module):
    cls = getattr(module, "TrainingArguments", None)
    prop = cls.__dict__.get("_setup_devices") if cls is not None else None
    if not isinstance(prop, functools.cached_property) or getattr(prop.func, "_rgpu", False):
        return
    original = prop.func

    def _setup_devices(self):
        use_cpu = self.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in (
            "1", "true", "yes", "y", "on")
        if use_cpu or "ACCELERATE_TORCH_DEVICE" in os.environ or not _rgpu_is_the_accelerator():
            return original(self)
        os.environ["ACCELERATE_TORCH_DEVICE"] = "rgpu"
        try:
            return original(self)
        finally:
            os.environ.pop("ACCELERATE_TORCH_DEVICE", None)

    _setup_devices._rgpu = True
    functools.update_wrapper(_setup_devices, original)
    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(cls, "_setup_devices")
    cls._setup_devices = patched


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once `name` is imported (its loader ran), before the importer sees
    the module."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the module's own finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, patch = spec.loader, self.patch

        def exec_module(module):
            type(loader).exec_module(loader, module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def _after_import(name, patch):
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


def install():
    _after_import("transformers.training_args", _patch_training_arguments)
