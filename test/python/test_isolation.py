"""Sessions on one server never see each other's data."""

from conftest import run_client


def test_an_empty_tensor_never_holds_another_sessions_bytes(fresh_server):
    writer = ("import torch, rgpu\n"
              "x = torch.full((1 << 20,), 1234.5, device='rgpu')\n"
              "assert x.sum().item() == 1234.5 * (1 << 20)\n"
              "del x\n"
              "rgpu.synchronize()\n")
    reader = ("import torch, rgpu\n"
              "for make in (lambda: torch.empty(1 << 20, device='rgpu'),\n"
              "             lambda: torch.empty_like(torch.ones(1 << 20, device='rgpu')),\n"
              "             lambda: torch.ones(3, device='rgpu').new_empty((1 << 20,)),\n"
              "             lambda: torch.empty_strided((1 << 20,), (1,), device='rgpu')):\n"
              "    print(int((make().cpu() != 0).sum()))\n"
              # Not the empty family: a kernel that leaves most of its output unwritten.
              "print(int((torch.ones(4, device='rgpu').resize_(1 << 20).cpu() != 0).sum()))\n")
    for _ in range(2):
        w = run_client(fresh_server.address, writer)
        assert w.returncode == 0, w.stderr
        r = run_client(fresh_server.address, reader)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["0", "0", "0", "0", "4"], r.stdout


def test_a_sessions_first_read_of_a_large_zero_tensor_arrives(fresh_server):
    # The first reply of a session carries the Hello's answer before the data: a reply that
    # packed its zeros a thousandfold once exceeded what the client lets a packed frame expand to.
    r = run_client(fresh_server.address,
                   "import torch, rgpu\nprint(int(torch.zeros(1 << 22, device='rgpu').cpu().sum()))")
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
