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

* **Lightning** has no accelerator for rgpu, and chooses by name among those it knows: rgpu
  registers one in Lightning's own registry, so `Trainer(accelerator="rgpu")` needs no user
  code; it trains on one device (the strategy Lightning picks for a device it does not know is
  the CPU's, whose device the accelerator sets to the rgpu one when training starts). With
  `accelerator="auto"` Lightning picks rgpu where rgpu is the accelerator, as it picks cuda,
  so a model on rgpu is never trained on the CPU behind the user's back.

* **Saving.** safetensors' `save_file` and `save` (which transformers' `save_pretrained` writes
  each shard with) read each tensor's bytes one after another: for a model on rgpu, one round
  trip per tensor (28 for a two-layer GPT-2). Each now fetches every rgpu tensor of its dict in
  one round trip at its first read (`_transfer.downloads_together`): one wait per file.

Each patch is applied when its module is imported (or at once if it was), and does nothing to
a release that lacks what it patches.
"""

import functools
import importlib
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


def _register_lightning_accelerator(module):
    """`module`: lightning.pytorch.accelerators (or pytorch_lightning.accelerators)."""
    registry = getattr(module, "AcceleratorRegistry", None)
    base = getattr(module, "Accelerator", None)
    if registry is None or base is None or "rgpu" in registry:
        return
    package = module.__name__.rsplit(".", 1)[0]

    def devices_of(devices):
        if devices in ("auto", -1, "-1"):
            return list(range(torch.rgpu.device_count()))
        if isinstance(devices, str):
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices \
                else int(devices)
        if isinstance(devices, int):
            return list(range(devices))
        return [int(d) for d in devices]

    class RgpuAccelerator(base):
        """rgpu-opserver's devices (rgpu:0, rgpu:1, ...)."""

        def setup_device(self, device):
            if device.type == "rgpu":
                torch.rgpu.set_device(device)

        def setup(self, trainer):
            # Lightning gives a device it does not know the CPU's single-device strategy.
            strategy = trainer.strategy
            single = importlib.import_module(package + ".strategies")  # not while Lightning loads
            if isinstance(strategy, single.SingleDeviceStrategy) and \
                    strategy.root_device.type != "rgpu":
                chosen = getattr(trainer, "_accelerator_connector", None)
                devices = getattr(chosen, "_parallel_devices", None) or [torch.device("rgpu", 0)]
                strategy._root_device = devices[0]
                torch.rgpu.set_device(devices[0])
            # Lightning's DDP takes every device that is not the CPU for CUDA (device ids, a
            # CUDA stream): rgpu's DDP is torch's with device_ids=None, as on the CPU.
            ddp = getattr(single, "DDPStrategy", None)
            if ddp is not None and isinstance(strategy, ddp) and \
                    strategy.root_device.type == "rgpu":
                strategy.determine_ddp_device_ids = lambda: None
            super().setup(trainer)

        def get_device_stats(self, device):
            index = torch.device(device).index or 0
            return {"allocated_bytes.all.current": torch.rgpu.memory_allocated(index),
                    "allocated_bytes.all.peak": torch.rgpu.max_memory_allocated(index)}

        def teardown(self):
            pass

        @staticmethod
        def parse_devices(devices):
            return devices_of(devices)

        @staticmethod
        def get_parallel_devices(devices):
            return [torch.device("rgpu", i) for i in devices_of(devices)]

        @staticmethod
        def auto_device_count():
            return torch.rgpu.device_count()

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def name():
            return "rgpu"

        @classmethod
        def register_accelerators(cls, accelerator_registry):
            accelerator_registry.register("rgpu", cls, description=cls.__doc__)

    RgpuAccelerator.register_accelerators(registry)


def _lightning_picks_rgpu(module):
    """`module`: Lightning's accelerator connector, whose "auto" picks tpu, mps, cuda or cpu."""
    original = getattr(module, "_select_auto_accelerator", None)
    if original is None or getattr(original, "_rgpu", False):
        return

    def _select_auto_accelerator():
        chosen = original()
        return "rgpu" if chosen == "cpu" and _rgpu_is_the_accelerator() else chosen

    _select_auto_accelerator._rgpu = True
    module._select_auto_accelerator = _select_auto_accelerator


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


def _fetching_together(fn, tensors_of):
    """`fn`, fetching the rgpu tensors `tensors_of(*args, **kwargs)` names in one round trip."""
    if getattr(fn, "_rgpu", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ._transfer import downloads_together

        with downloads_together(tensors_of(*args, **kwargs)):
            return fn(*args, **kwargs)

    wrapper._rgpu = True
    return wrapper


def _group_safetensors_saves(module):
    def values(tensors=None, *args, **kwargs):
        return list(tensors.values()) if isinstance(tensors, dict) else []

    for name in ("save", "save_file"):
        if callable(getattr(module, name, None)):
            setattr(module, name, _fetching_together(getattr(module, name), values))


def _after_import(name, patch):
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


def install():
    _after_import("transformers.training_args", _patch_training_arguments)
    # Before transformers.modeling_utils binds safetensors' save_file by name.
    _after_import("safetensors.torch", _group_safetensors_saves)
    for package in ("lightning.pytorch", "pytorch_lightning"):
        _after_import(package + ".accelerators", _register_lightning_accelerator)
        _after_import(package + ".trainer.connectors.accelerator_connector", _lightning_picks_rgpu)
