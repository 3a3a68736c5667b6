"""The python tool's sandbox contains hostile code; each attack becomes an error observation in time.

Every check is against the host's state (the test process alive, a file absent, a listening socket
never connected to, a secret absent), not against the sandbox's own report.
"""
import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from megarl.rollout.tools.python_sandbox import PythonSandboxTool

TIMEOUT_S = 3.0
SECRET = "megarl-test-secret-7c1f"


@pytest.fixture
def sandbox():
    return PythonSandboxTool(timeout_s=TIMEOUT_S, cpu_s=2, memory_mb=512, max_processes=32,
                             max_output_chars=2000)


async def timed(tool, code):
    start = time.monotonic()
    text = await tool({"code": code})
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 2.0, f"took {elapsed:.1f}s"
    return text


@pytest.mark.timeout(30)
async def test_runs_code_and_reports_isolation(sandbox):
    assert (await timed(sandbox, "print(sum(range(10)))")).strip() == "45"
    assert sandbox.isolation in ("namespaces", "rlimits-only")
    if os.geteuid() == 0:
        assert sandbox.isolation == "namespaces"


@pytest.mark.timeout(30)
async def test_infinite_loop_and_sleep_are_killed(sandbox):
    for code in ("while True:\n    pass", "import time\ntime.sleep(600)"):
        text = await timed(sandbox, code)
        assert "Error:" in text and ("timed out" in text or "SIGKILL" in text or "SIGXCPU" in text)


@pytest.mark.timeout(30)
async def test_fork_bomb_is_contained(sandbox):
    before = len(os.listdir("/proc"))
    text = await timed(sandbox, "import os\nwhile True:\n    os.fork()")
    assert "Error:" in text
    # No process left behind on the host (allow for unrelated churn on a shared machine): the killed
    # ones are gone once reaped, which takes a moment on a loaded machine.
    deadline = asyncio.get_running_loop().time() + 10
    while len(os.listdir("/proc")) >= before + 16 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert len(os.listdir("/proc")) < before + 16


@pytest.mark.timeout(30)
async def test_huge_allocation_fails(sandbox):
    text = await timed(sandbox, "x = bytearray(10 * 1024 ** 3)\nprint('allocated')")
    assert "MemoryError" in text and "allocated" not in text


@pytest.mark.timeout(30)
async def test_no_network(sandbox):
    if sandbox.isolate and os.geteuid() != 0:
        pytest.skip("network isolation needs root or user namespaces")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "print('connected')")
        text = await timed(sandbox, code)
        assert "connected" not in text.replace("not connected", "") and "Error:" in text
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected
    finally:
        server.close()


@pytest.mark.timeout(30)
async def test_cannot_write_outside_its_directory(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    home_target = "/root/megarl-sandbox-escape.txt"
    repo_target = str(Path(__file__).resolve().parents[3] / ".megarl-sandbox-escape.txt")
    code = (f"import os\nopen('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
            f"for p in [{str(target)!r}, {home_target!r}, {repo_target!r}]:\n"
            f"    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            f"    except OSError as e:\n        print('refused', p, type(e).__name__)\n")
    text = await timed(sandbox, code)
    assert "ok" in text and "WROTE" not in text
    assert not target.exists() and not os.path.exists(home_target)
    assert not os.path.exists(repo_target)


@pytest.mark.timeout(30)
async def test_cannot_read_parent_environment(sandbox, monkeypatch):
    monkeypatch.setenv("MEGARL_SECRET_TOKEN", SECRET)
    code = ("import os\nprint(dict(os.environ))\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        try:\n            print(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "        except OSError as e:\n            print(pid, type(e).__name__)\n"
            f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
            "except OSError as e:\n    print('parent', type(e).__name__)\n")
    text = await timed(sandbox, code)
    assert SECRET not in text and "MEGARL_SECRET_TOKEN" not in text


@pytest.mark.timeout(30)
async def test_cannot_kill_its_parent(sandbox):
    code = (f"import os, signal\n"
            f"for pid in (os.getppid(), {os.getpid()}, {os.getppid()}):\n"
            f"    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed', pid)\n"
            f"    except OSError as e:\n        print('refused', pid, type(e).__name__)\n"
            f"os.kill(-1, signal.SIGKILL)\n")
    text = await timed(sandbox, code)
    assert "Error:" in text or "refused" in text
    os.kill(os.getpid(), 0)  # this process is alive
    os.kill(os.getppid(), 0)  # and so is its parent
    assert (await timed(sandbox, "print('still working')")).strip() == "still working"


@pytest.mark.timeout(30)
async def test_output_is_truncated(sandbox):
    text = await timed(sandbox, "print('x' * 100000)")
    assert len(text) <= 2000 + 100 and "[output truncated]" in text


@pytest.mark.timeout(60)
async def test_attacks_in_one_turn_of_the_agent_loop(tokenizer, scripted_engine):
    """All attacks in one turn run concurrently; the loop gets error observations and carries on."""
    import json

    from rollout_scripted import Reply

    from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
    from megarl.rollout.template import ChatTemplate
    from megarl.rollout.tools.calls import ToolCallParser
    from megarl.rollout.types import RolloutStatus

    attacks = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(10 * 2**30)",
               "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)",
               "open('/root/x', 'w')", "import os; os.kill(os.getppid(), 9); os.kill(-1, 9)"]
    calls = "\n".join("<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": c}})
                      + "\n</tool_call>" for c in attacks)
    turns = [calls, "\\boxed{1}"]
    engine = scripted_engine(lambda ids, k: Reply(turns[k]))
    tools = {"python": PythonSandboxTool(timeout_s=TIMEOUT_S, cpu_s=2, memory_mb=512)}
    ctx = AgentContext(engine=engine, template=ChatTemplate(tokenizer, [tools["python"].schema]),
                       tools=tools, parser=ToolCallParser(tools), tool_timeout_s=TIMEOUT_S + 5,
                       sampling_params={"max_new_tokens": 512}, max_tool_output_chars=500,
                       max_response_tokens=8000, max_context_tokens=8192)
    state = new_state(ctx, ctx.template.prompt_ids([{"role": "user", "content": "hi"}]), {}, 0)
    start = time.monotonic()
    traj = await run_agent(tool_agent, ctx, state)
    assert time.monotonic() - start < TIMEOUT_S + 4  # concurrently, not one after another
    assert traj.status == RolloutStatus.COMPLETED and traj.num_turns == 2
    assert traj.metadata["tool_calls"] == len(attacks) == traj.metadata["tool_errors"]


@pytest.mark.timeout(30)
async def test_rlimits_only_mode_still_limits_cpu_memory_and_env(monkeypatch):
    monkeypatch.setenv("MEGARL_SECRET_TOKEN", SECRET)
    tool = PythonSandboxTool(timeout_s=TIMEOUT_S, cpu_s=1, memory_mb=512, isolate=False)
    assert "MemoryError" in await timed(tool, "bytearray(10 * 1024 ** 3)")
    assert "Error:" in await timed(tool, "while True: pass")
    text = await timed(tool, "import os; print(dict(os.environ))")
    assert SECRET not in text and tool.isolation == "rlimits-only"
