"""The client from several Python threads: one traces and syncs while another frees tensors
and traces from thousands of new source lines. Before the session lock stopped taking the GIL,
the log sink (under the lock) and a tensor freed by Python (holding the GIL) deadlocked, and
the source-line table grew while another thread read it."""

import textwrap

from conftest import run_client

STRESS = textwrap.dedent("""
    import logging, threading, time, torch, rgpu
    # Debug records from every cut and wait, through a handler that drops them.
    logging.getLogger("rgpu").handlers[:] = [logging.NullHandler()]
    lines = "\\n".join(f"    y = y + {i}" for i in range(3000))
    exec(f"def many_lines(y):\\n{lines}\\n    return y", globals())
    stop = False
    def churn():
        many_lines(torch.ones(2, device="rgpu"))  # 3000 new source lines while the other syncs
        while not stop:
            xs = [torch.ones(2, device="rgpu") for _ in range(500)]
            while xs:
                xs.pop()        # freed by Python, holding the GIL: each takes the session lock
    t = threading.Thread(target=churn)
    t.start()
    x = torch.ones(4, device="rgpu")
    start = time.time()
    for i in range(200):
        x = x * 1.0
        assert x.sum().item() == 4.0
        rgpu.mark_step(wait=True)
    stop = True
    t.join()
    print("done", round(time.time() - start, 1))
""")


def test_a_thread_freeing_tensors_while_another_syncs_and_logs_never_deadlocks(server):
    r = run_client(server.address, STRESS, env={"RGPU_LOG": "debug"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("done"), r.stdout + r.stderr[-3000:]


LOCK_FREE_LOGGING = textwrap.dedent("""
    import logging, threading, torch, rgpu
    # A handler that, for each record, has another thread use rgpu (which takes the session
    # lock): if records were emitted with the lock held, that thread could not finish.
    blocked = []
    class Probe(logging.Handler):
        def emit(self, record):
            t = threading.Thread(target=lambda: torch.ones(1, device="rgpu"))
            t.start()
            t.join(timeout=5)
            if t.is_alive():
                blocked.append(record.getMessage())
    logger = logging.getLogger("rgpu")
    logger.handlers[:] = [Probe()]
    x = torch.ones(4, device="rgpu")
    for _ in range(5):
        x = x + 1
        x.sum().item()             # cuts and waits log at debug level
    print("blocked", len(blocked))
""")


def test_log_records_are_emitted_after_the_session_lock_is_released(server):
    r = run_client(server.address, LOCK_FREE_LOGGING, env={"RGPU_LOG": "debug"}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "blocked 0", r.stdout + r.stderr[-2000:]
