"""torch.distributed on rgpu: the c10d backend "rgpu".

``dist.init_process_group("rgpu")`` (one client process per rank, as torchrun starts them) makes
each rank's rgpu-opserver join a Gloo process group with the servers of the other ranks. A
collective on rgpu tensors is then recorded into the lazy graph as one of torch's functional
collectives (``_c10d_functional.all_reduce`` and friends) and runs on the servers, between
them: tensors never pass through the clients, and a collective costs the client no message of
its own. ``DistributedDataParallel`` works unchanged on top (its buckets are all-reduced by
the servers inside the step's graph).

The servers' rendezvous: rank 0's server starts a store (``rgpu-opserver --store-host``), and
its address, which carries the secret the store asks the servers for, reaches the other ranks
through the job's own store (torchrun's), so the other servers can connect to it. CPU tensors given to these collectives are moved to rgpu for the
collective and back.
"""

import uuid

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from . import _C

_ops = torch.ops._c10d_functional

_REDUCE = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}


def _done(result):
    """A Work already complete: the collective is ordered in the graph, and whatever reads its
    result waits for the server."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduce_op(opts):
    op = _REDUCE.get(opts.reduceOp.op)
    if op is None:
        raise ValueError(f"rgpu's process group does not support the reduction {opts.reduceOp}")
    return op


class ProcessGroupRgpu(dist.ProcessGroup):
    """The collectives of one process group, run by the servers of the job's ranks."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        import torch.distributed._functional_collectives  # noqa: F401  (their meta kernels)

        millis = int(timeout.total_seconds() * 1000)
        if rank == 0:
            address = _C.host_store()
            store.set("rgpu/rendezvous", f"{address} {uuid.uuid4().hex}")
        store.wait(["rgpu/rendezvous"], timeout)
        address, prefix = store.get("rgpu/rendezvous").decode().split()
        self._group = _C.join_group("" if rank == 0 else address, prefix, rank, size, millis)

    def getBackendName(self):
        return "rgpu"

    # c10d asks a group for its backend of a device when init_process_group is given a
    # device_id (Lightning's DDP gives its root device): this group is its own, and it makes no
    # subgroups by splitting.
    supports_splitting = False

    def _get_backend(self, device):
        return self

    def _each(self, tensors, collective):
        """Runs `collective` (an rgpu tensor -> its result) for each tensor, in place."""
        for t in tensors:
            on_rgpu = t if t.device.type == "rgpu" else t.to("rgpu")
            result = _ops.wait_tensor(collective(on_rgpu))
            if t.device.type != "rgpu":
                t.copy_(result.to(t.device))
            elif torch._is_functional_tensor(t):
                t.copy_(result)
            else:
                # Made by torch's C++ (DDP's checks), not wrapped for functionalization: the
                # copy reaches rgpu's kernel as the mutation of a composite kernel would.
                torch._sync(result)
                t.copy_(torch._from_functional_tensor(result))
        return _done(tensors)

    def allreduce(self, tensors, opts):
        op = _reduce_op(opts)
        return self._each(tensors, lambda t: _ops.all_reduce(t, op, self._group))

    def broadcast(self, tensors, opts):
        root = opts.rootRank
        return self._each(tensors, lambda t: _ops.broadcast(t, root, self._group))

    def gather_into(self, output, input):
        """all_gather_into_tensor: `output` gets every rank's `input`, concatenated."""
        return self._each([output], lambda out: _ops.all_gather_into_tensor(
            input.to("rgpu"), self.size(), self._group))

    def scatter_into(self, output, input, op):
        """reduce_scatter_tensor: `output` gets this rank's part of the reduced `input`."""
        return self._each([output], lambda out: _ops.reduce_scatter_tensor(
            input.to("rgpu"), op, self.size(), self._group))

    # torch.distributed's Python functions call these on the group itself (torch's C++
    # versions look for a C++ backend of the tensors' device, which this group does not have).
    def all_gather_single(self, output, input, opts=None):
        return self.gather_into(output, input)

    def reduce_scatter_single(self, output, input, opts):
        return self.scatter_into(output, input, _reduce_op(opts))

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def allgather(self, output_lists, inputs, opts):
        for outputs, t in zip(output_lists, inputs):
            n = t.numel()
            gathered = torch.empty(self.size() * n, dtype=t.dtype, device="rgpu")
            self.gather_into(gathered, t.reshape(-1))
            for k, out in enumerate(outputs):
                part = gathered[k * n:(k + 1) * n].view(out.shape)
                out.copy_(part if out.device.type == "rgpu" else part.to(out.device))
        return _done(output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        for out, t in zip(outputs, inputs):
            self.gather_into(out, t)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts):
        for out, inputs in zip(outputs, input_lists):
            self.scatter_into(out, torch.cat([t.to("rgpu") for t in inputs]), _reduce_op(opts))
        return _done(outputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for out, t in zip(outputs, inputs):
            self.scatter_into(out, t, _reduce_op(opts))
        return _done(outputs)

    def barrier(self, opts=None):
        # Every rank's server reaches the same all-reduce; reading it waits for all of them.
        token = torch.zeros(1, device="rgpu")
        _ops.wait_tensor(_ops.all_reduce(token, "sum", self._group)).item()
        return _done([token])


def _create(store, rank, size, timeout):
    return ProcessGroupRgpu(store, rank, size, timeout)


def _verify_params_across_processes(process_group, tensors, logger=None):
    """DistributedDataParallel's check that every rank has the same parameters (torch's is C++
    code that copies an rgpu tensor into a CPU one past functionalization, which refuses it)."""
    if not isinstance(process_group, ProcessGroupRgpu):
        return _torch_verify_params(process_group, tensors, logger)
    meta = [len(tensors)] + [n for t in tensors for n in (t.dim(), *t.shape, *t.stride())]
    size = process_group.size()
    lengths = torch.zeros(size, dtype=torch.long, device="rgpu")
    process_group.gather_into(lengths, torch.tensor([len(meta)], device="rgpu"))
    longest = int(lengths.max().item())
    padded = torch.tensor(meta + [-1] * (longest - len(meta)), device="rgpu")
    gathered = torch.empty(size * longest, dtype=torch.long, device="rgpu")
    process_group.gather_into(gathered, padded)
    everyone = gathered.cpu().view(size, longest).tolist()
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise RuntimeError(
                f"DDP expects the same parameters on every rank, but rank {rank}'s number, "
                f"sizes or strides of parameters differ from rank 0's")


class _Reducer(dist.Reducer):
    """DistributedDataParallel's reducer. Over an rgpu group it keeps its first bucket order:
    rebuilding the buckets in the order gradients became ready is an optimization whose C++
    code copies the new order from an rgpu tensor into a CPU one past functionalization."""

    def __init__(self, parameters, buckets, limits, process_group, *args, **kwargs):
        super().__init__(parameters, buckets, limits, process_group, *args, **kwargs)
        self._keep_buckets = isinstance(process_group, ProcessGroupRgpu)

    def _rebuild_buckets(self):
        return False if self._keep_buckets else super()._rebuild_buckets()


dist.Reducer = _Reducer
_torch_verify_params = dist._verify_params_across_processes
dist._verify_params_across_processes = _verify_params_across_processes
dist.Backend.register_backend("rgpu", _create, devices=["rgpu"])
