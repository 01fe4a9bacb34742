"""Sessions on one server never see each other's data."""

from conftest import run_client


def test_an_empty_tensor_never_holds_another_sessions_bytes(fresh_server):
    writer = ("import torch, rgpu\n"
              "x = torch.full((1 << 20,), 1234.5, device='rgpu')\n"
              "assert x.sum().item() == 1234.5 * (1 << 20)\n"
              "del x\n"
              "rgpu.synchronize()\n"
              # The session's own freed block, reused for its next tensor of that size: an
              # empty tensor is zeros there too.
              "assert int((torch.empty(1 << 20, device='rgpu').cpu() != 0).sum()) == 0\n")
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


def test_a_forked_child_leaves_its_parents_session_alone(server):
    # A forked child shares its parent's socket. It must neither end the parent's session at
    # exit (a Bye) nor read its replies; using rgpu there raises, and rgpu.reset() gives the
    # child a session of its own.
    script = r"""
import os, sys, torch, rgpu
import torch.utils.data as D
w = torch.arange(4.0).to('rgpu')
assert w.sum().item() == 6

def fork(child):
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = child()
        except BaseException as e:
            msg = f'{type(e).__name__}: {e}'
        os.write(wfd, msg.encode())
        sys.exit(0)  # atexit handlers run, as at a normal exit
    os.close(wfd)
    out = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    return out

print(fork(lambda: 'idle'))
def uses_inherited():
    try:
        (w * 2).sum().item()
        return 'no error'
    except rgpu.SessionLost as e:
        first = 'forked' in str(e)
    rgpu.reset()
    x = torch.full((3,), 2.0, device='rgpu')
    return f'{first} {(x * x).sum().item()}'
print(fork(uses_inherited))
del w  # the parent's releases still go through
ds = D.TensorDataset(torch.arange(32.0))
total = sum((b.to('rgpu') * 2).sum().item() for (b,) in D.DataLoader(ds, batch_size=8, num_workers=2))
v = torch.ones(5, device='rgpu')
print(total, v.sum().item(), rgpu.stats()['reconnects'])
"""
    r = run_client(server.address, script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["idle", "True 12.0", "992.0 5.0 0"], r.stdout


def test_a_resize_grows_into_zeros_even_over_a_block_the_session_freed(fresh_server):
    # A session's freed blocks are reused as they were, for its own next allocations of that
    # size; a resize's grown part is zeroed all the same, as on a CUDA server, whose allocator
    # hands out what another session left.
    code = ("import torch, rgpu\n"
            "x = torch.full((1 << 20,), 7.0, device='rgpu')\n"
            "rgpu.synchronize()\n"
            "del x\n"
            "rgpu.synchronize()\n"
            "y = torch.ones(4, device='rgpu').resize_(1 << 20)\n"
            "z = torch.empty(0, device='rgpu')\n"
            "torch.exp(torch.zeros(3, device='rgpu'), out=z)\n"
            "print(int((y.cpu() != 0).sum()), z.cpu().tolist())\n")
    r = run_client(fresh_server.address, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4", "[1.0,", "1.0,", "1.0]"], r.stdout
