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
import tempfile
import threading

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


def _patch_safe_open(module):
    """safetensors.safe_open of a remote path reads the file on the server (rgpu.remote)."""
    safe_open = getattr(module, "safe_open", None)
    if safe_open is None or getattr(safe_open, "_rgpu", False):
        return

    @functools.wraps(safe_open, updated=())
    def safe_open_(filename, framework, device="cpu", *args, **kwargs):
        from .remote import RemotePath, SafeOpen

        if isinstance(filename, RemotePath):
            return SafeOpen(filename, framework, device)
        return safe_open(filename, framework, device, *args, **kwargs)

    safe_open_._rgpu = True
    module.safe_open = safe_open_


def _patch_safetensors(module):
    """safetensors' save and save_file fetch their rgpu tensors in one round trip; save_file
    and load_file take remote paths (rgpu.remote), and files that save_pretrained writes into
    a remote directory go there."""
    def values(tensors=None, *args, **kwargs):
        return list(tensors.values()) if isinstance(tensors, dict) else []

    if callable(getattr(module, "save", None)):
        module.save = _fetching_together(module.save, values)
    save_file, load_file = getattr(module, "save_file", None), getattr(module, "load_file", None)
    if callable(save_file) and not getattr(save_file, "_rgpu", False):
        grouped = _fetching_together(save_file, values)

        @functools.wraps(save_file)
        def save_file_(tensors, filename, metadata=None, *args, **kwargs):
            where = _remote_target(filename)
            if where is not None:
                from .remote import save_safetensors

                return save_safetensors(tensors, where, metadata)
            return grouped(tensors, filename, metadata, *args, **kwargs)

        save_file_._rgpu = True
        module.save_file = save_file_
    if callable(load_file) and not getattr(load_file, "_rgpu", False):
        @functools.wraps(load_file)
        def load_file_(filename, device="cpu", *args, **kwargs):
            from .remote import RemotePath, load_safetensors

            if isinstance(filename, RemotePath):
                return load_safetensors(filename, device if device != "cpu" else None)
            return load_file(filename, device, *args, **kwargs)

        load_file_._rgpu = True
        module.load_file = load_file_


_redirect = threading.local()


def _remote_target(filename):
    """The remote path a save to `filename` goes to: filename itself, or a file in the local
    directory that save_pretrained of a remote directory writes into."""
    from .remote import RemotePath

    if isinstance(filename, RemotePath):
        return filename
    into = getattr(_redirect, "into", None)
    if into is None or not isinstance(filename, (str, os.PathLike)):
        return None
    local, remote = into
    rel = os.path.relpath(os.path.abspath(os.fspath(filename)), local)
    return None if rel.startswith("..") else remote / rel.replace(os.sep, "/")


def _patch_pretrained(module):
    """transformers.modeling_utils: save_pretrained and from_pretrained of a remote directory."""
    cls = getattr(module, "PreTrainedModel", None)
    if cls is None or getattr(cls.save_pretrained, "_rgpu", False):
        return
    save_pretrained, from_pretrained = cls.save_pretrained, cls.from_pretrained.__func__

    @functools.wraps(save_pretrained)
    def save_pretrained_(self, save_directory, *args, **kwargs):
        from .remote import RemotePath

        if not isinstance(save_directory, RemotePath):
            return save_pretrained(self, save_directory, *args, **kwargs)
        # Written here, but for the weights, which go from the server's tensors to the remote
        # directory (safetensors' save_file, above); then the small files follow them.
        with tempfile.TemporaryDirectory() as local:
            _redirect.into = (os.path.abspath(local), save_directory)
            try:
                save_pretrained(self, local, *args, **kwargs)
            finally:
                _redirect.into = None
            _copy_to_remote(local, save_directory)

    @functools.wraps(from_pretrained)
    def from_pretrained_(cls, pretrained, *args, **kwargs):
        from .remote import RemotePath, load_pretrained

        if not isinstance(pretrained, RemotePath):
            return from_pretrained(cls, pretrained, *args, **kwargs)
        return load_pretrained(cls, pretrained, *args, **kwargs)

    save_pretrained_._rgpu = from_pretrained_._rgpu = True
    cls.save_pretrained = save_pretrained_
    cls.from_pretrained = classmethod(from_pretrained_)


def _copy_to_remote(local, remote):
    """Copies the files of local directory `local` into remote directory `remote`."""
    for root, _, files in os.walk(local):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local).replace(os.sep, "/")
            with open(os.path.join(root, name), "rb") as f:
                (remote / rel).write_bytes(f.read())


def _patch_small_files(module, names):
    """Classes of `module` whose files are small (configs, tokenizers): `from_pretrained` of a
    remote directory reads a local copy of its files but the weights, and `save_pretrained`
    into one writes locally, then copies the files there."""
    for name in names:
        cls = getattr(module, name, None)
        if cls is None or getattr(cls.__dict__.get("from_pretrained"), "_rgpu", False):
            continue
        from_pretrained = cls.from_pretrained.__func__

        @functools.wraps(from_pretrained)
        def from_pretrained_(cls, pretrained, *args, _original=from_pretrained, **kwargs):
            from .remote import RemotePath, fetch_small_files

            if not isinstance(pretrained, RemotePath):
                return _original(cls, pretrained, *args, **kwargs)
            with tempfile.TemporaryDirectory() as local:
                fetch_small_files(pretrained, local)
                return _original(cls, local, *args, **kwargs)

        from_pretrained_._rgpu = True
        cls.from_pretrained = classmethod(from_pretrained_)
        save_pretrained = cls.__dict__.get("save_pretrained")
        if save_pretrained is None:
            continue

        @functools.wraps(save_pretrained)
        def save_pretrained_(self, directory, *args, _original=save_pretrained, **kwargs):
            from .remote import RemotePath

            if not isinstance(directory, RemotePath):
                return _original(self, directory, *args, **kwargs)
            with tempfile.TemporaryDirectory() as local:
                out = _original(self, local, *args, **kwargs)
                _copy_to_remote(local, directory)
            return out

        cls.save_pretrained = save_pretrained_


def _patch_auto_models(module):
    """transformers' Auto classes: from_pretrained of a remote directory picks the model class
    from its config.json, whose class then loads it (_patch_pretrained)."""
    cls = getattr(module, "_BaseAutoModelClass", None)
    if cls is None or getattr(cls.from_pretrained, "_rgpu", False):
        return
    from_pretrained = cls.from_pretrained.__func__

    @functools.wraps(from_pretrained)
    def from_pretrained_(cls, pretrained, *args, **kwargs):
        from .remote import RemotePath, remote_config

        if not isinstance(pretrained, RemotePath):
            return from_pretrained(cls, pretrained, *args, **kwargs)
        config = kwargs.pop("config", None) or remote_config(pretrained)
        model_class = module._get_model_class(config, cls._model_mapping)
        return model_class.from_pretrained(pretrained, *args, config=config, **kwargs)

    from_pretrained_._rgpu = True
    cls.from_pretrained = classmethod(from_pretrained_)


def _after_import(name, patch):
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


def install():
    _after_import("transformers.training_args", _patch_training_arguments)
    # Before transformers.modeling_utils binds safetensors' save_file by name.
    _after_import("safetensors", _patch_safe_open)
    _after_import("safetensors.torch", _patch_safetensors)
    _after_import("transformers.modeling_utils", _patch_pretrained)
    _after_import("transformers.models.auto.auto_factory", _patch_auto_models)
    for module, names in (("transformers.configuration_utils", ("PretrainedConfig",)),
                          ("transformers.tokenization_utils_base", ("PreTrainedTokenizerBase",)),
                          ("transformers.generation.configuration_utils", ("GenerationConfig",)),
                          ("transformers.models.auto.configuration_auto", ("AutoConfig",)),
                          ("transformers.models.auto.tokenization_auto", ("AutoTokenizer",))):
        _after_import(module, functools.partial(_patch_small_files, names=names))
    for package in ("lightning.pytorch", "pytorch_lightning"):
        _after_import(package + ".accelerators", _register_lightning_accelerator)
        _after_import(package + ".trainer.connectors.accelerator_connector", _lightning_picks_rgpu)
