"""torch.rgpu's memory and device functions, shaped like torch.cuda's and answered by the server
(here a CPU server: the bytes its sessions hold, its memory limit, its processor). test_cuda.py
checks them against torch.cuda on a CUDA server."""

import gc

import pytest
import torch
from conftest import Server, run_client

import rgpu


def test_allocated_follows_the_tensors_of_the_session():
    before = torch.rgpu.memory_allocated()
    x = torch.ones(1024, 1024, device="rgpu")  # counted although still pending: it is run first
    held = torch.rgpu.memory_allocated()
    assert held - before >= 4 << 20
    assert torch.rgpu.memory_reserved() >= held
    assert torch.rgpu.max_memory_allocated() >= held
    stats = torch.rgpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == held
    del x
    assert torch.rgpu.memory_allocated() == before


def test_peak_and_its_reset():
    # Tensors an earlier test left to the garbage collector are released first: a release
    # between the reset and the next reading would lower the current bytes below the peak.
    gc.collect()
    torch.rgpu.synchronize()
    torch.rgpu.reset_peak_memory_stats()
    base = torch.rgpu.max_memory_allocated()
    assert base == torch.rgpu.memory_allocated()
    y = torch.zeros(2048, 1024, device="rgpu")
    y.sum().item()
    del y
    assert torch.rgpu.max_memory_allocated() >= base + (8 << 20)
    assert torch.rgpu.memory_allocated() < base + (8 << 20)
    torch.rgpu.reset_peak_memory_stats()
    assert torch.rgpu.max_memory_allocated() == torch.rgpu.memory_allocated()
    torch.rgpu.empty_cache()  # nothing cached on a CPU server, and no error


def test_device_properties_and_info():
    props = torch.rgpu.get_device_properties()
    assert props.type == "cpu"
    assert props.name == torch.rgpu.get_device_name() and props.name
    assert props.multi_processor_count >= 1
    assert torch.rgpu.get_device_capability() == (0, 0)
    free, total = torch.rgpu.mem_get_info()
    assert 0 < free <= total == props.total_memory
    assert torch.rgpu.get_device_properties("rgpu:0") == props
    with pytest.raises(ValueError, match="rgpu:1"):
        torch.rgpu.memory_allocated(1)


def test_torch_accelerator_memory_functions_are_the_servers():
    # Device-agnostic code asks torch.accelerator, which asks the device's DeviceAllocator.
    mem = torch.accelerator.memory
    x = torch.ones(1024, 1024, device="rgpu")
    assert mem.memory_allocated() == torch.rgpu.memory_allocated() >= 4 << 20
    assert mem.max_memory_allocated() >= mem.memory_allocated()
    assert mem.memory_reserved() >= mem.memory_allocated()
    mem.reset_peak_memory_stats()
    assert mem.max_memory_allocated() == mem.memory_allocated()
    mem.empty_cache()
    del x


def test_streams_and_events_order_work_as_the_one_stream_does():
    # A CUDA prefetcher's pattern: each rgpu stream is the device's one stream, which runs work
    # in trace order; waiting on a stream or event waits for what was traced.
    side = torch.rgpu.Stream()
    x = torch.randn(4, 4)
    with torch.rgpu.stream(side):
        y = x.to("rgpu", non_blocking=True) * 2
    torch.rgpu.current_stream().wait_stream(side)
    event = torch.rgpu.Event()
    event.record()
    event.synchronize()
    assert event.query() and side.query()
    side.synchronize()
    assert torch.equal(y.cpu(), x * 2)
    assert torch.rgpu.is_bf16_supported()
    start, end = torch.rgpu.Event(enable_timing=True), torch.rgpu.Event(enable_timing=True)
    start.record()
    end.record()
    with pytest.raises(NotImplementedError, match="no device clock"):
        start.elapsed_time(end)


def test_a_memory_limit_is_the_total_and_counts_every_session():
    s = Server("--memory-limit", "256MiB")
    try:
        code = """
import torch, rgpu
x = torch.ones(16, 1024, 1024, device="rgpu")
free, total = torch.rgpu.mem_get_info()
print(total, free, torch.rgpu.memory_allocated())
"""
        r = run_client(s.address, code)
        assert r.returncode == 0, r.stderr
        total, free, allocated = map(int, r.stdout.split())
        assert total == 256 << 20
        assert allocated >= 64 << 20 and free <= total - (64 << 20)
    finally:
        s.stop()


def test_a_session_keeps_the_blocks_it_freed_and_gives_them_back_when_it_ends():
    s = Server()
    try:
        code = """
import torch, rgpu
x = torch.ones(1024, 1024, device="rgpu")
torch.rgpu.memory_allocated()  # x runs first
before = rgpu.server_stats()
del x
after = rgpu.server_stats()  # the release goes with this request
assert after["memory_held"] <= before["memory_held"] - (4 << 20), (before, after)
print(after["memory_kept"] - before["memory_kept"])
y = torch.ones(1024, 1024, device="rgpu")  # the same size: the kept block again
assert y.sum().item() == 1 << 20
print(rgpu.server_stats()["memory_kept"] - before["memory_kept"])
"""
        r = run_client(s.address, code)
        assert r.returncode == 0, r.stderr
        kept, again = map(int, r.stdout.split())
        # Taken again (what remains kept is the small tensors of the sum).
        assert kept >= 4 << 20 and again < kept - (4 << 20) + 4096, (kept, again)
        # The session ended with its client: what it kept is freed.
        r = run_client(s.address, "import rgpu\nprint(rgpu.server_stats()['memory_kept'])")
        assert r.returncode == 0 and r.stdout.split() == ["0"], (r.stdout, r.stderr)
    finally:
        s.stop()
