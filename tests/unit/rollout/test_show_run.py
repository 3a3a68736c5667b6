"""``megarl show``: a run directory written by ``write_rollouts`` from trajectories of the real agent
loop (Qwen3's official template and reasoning parser, the real calculator tool, a composite reward;
the scripted engine of these unit tests in place of SGLang), rendered in the terminal and as an HTML
page (sorted, filtered and opened through its query string in a real headless Chromium).

References: the trajectories themselves (each span of equal ``loss_mask`` decoded by the tokenizer,
the tool outputs, the rewards and their terms, the engine's weight versions), and for the page a real
headless Chromium (Debian's package): its DOM text holds the turns and its screenshot is not blank.
"""
import io
import json
import re
import shutil
import subprocess

import pytest
from rollout_scripted import Reply, ScriptedEngine

from megarl.launch.rollout_log import write_rollouts
from megarl.launch.show import ShowError, show, step_summary
from megarl.rollout.agent import AgentContext, new_state, run_agent, tool_agent
from megarl.rollout.rewards.composite import CompositeReward
from megarl.rollout.template import build_template
from megarl.rollout.tools import build_tools
from megarl.rollout.types import TrajectoryGroup

QUESTION = "Natalia sold 48 clips in April and half as many in May. How many in all?"


def call(expression):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


SCRIPTS = [  # a correct trajectory over two weight versions, a wrong one, a failing tool call
    [Reply("<think>\nMay is half of April.\n</think>\n\n" + call("48 / 2"), weight_version="3"),
     Reply("<think>\nNow the sum.\n</think>\n\n" + call("48 + 24"), weight_version="4"),
     Reply("<think>\nSo 72.\n</think>\n\nThe answer is \\boxed{72}.", weight_version="4")],
    [Reply("<think>\nGuess.\n</think>\n\nThe answer is \\boxed{70}.", weight_version="3")],
    [Reply("<think>\nDivide.\n</think>\n\n" + call("48 / zero"), weight_version="3"),
     Reply("<think>\nThe tool failed.\n</think>\n\nThe answer is \\boxed{72}.", weight_version="3")],
]


async def trajectories(tokenizer):
    tools = build_tools({"calculator": {}})
    agent = type("Agent", (), {"system_prompt": None, "reasoning_parser": "auto", "tool_call_parser": "auto",
                               "chat_template_kwargs": {}})()
    template, parser = build_template(tokenizer, agent, tools)
    reward = CompositeReward(terms={"correct": {"fn": "gsm8k", "kwargs": {"executor": "inline"}},
                                    "format": {"fn": "answer_format", "weight": 0.5}})
    sample = {"prompt": QUESTION, "answer": "... #### 72"}
    out = []
    for script in SCRIPTS:
        engine = ScriptedEngine(tokenizer, lambda ids, k, s=script: s[k])
        ctx = AgentContext(engine=engine, template=template, tools=tools, parser=parser, max_turns=4,
                           sampling_params={"temperature": 1.0, "max_new_tokens": 200}, policy_version=3)
        state = new_state(ctx, template.prompt_ids([{"role": "user", "content": QUESTION}]), sample, group_id=0)
        traj = await run_agent(tool_agent, ctx, state)
        traj.reward = await reward(traj, sample)
        out.append(traj)
    return out


def parts(tok, ids, trained):
    """A span's decoded text (special tokens kept; a model turn's final EOS dropped) cut at the think
    tags, each part's words."""
    text = tok.decode(ids, skip_special_tokens=False).replace("<think>", "")
    text = text.removesuffix(tok.eos_token) if trained else text
    return [" ".join(part.split()) for part in text.split("</think>") if part.strip()]


def flatten(text):
    """The words of rendered text, without the panels' frames and line breaks."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


def spans(traj):
    """(text, trained) per run of equal loss_mask: the reference for the turns shown."""
    ids, mask, out, start = traj.response_ids.tolist(), traj.loss_mask.tolist(), [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            out.append((ids[start:i], bool(mask[start])))
            start = i
    return out


@pytest.fixture(scope="module")
def run_dir(official_template_tokenizers, tmp_path_factory):
    import asyncio

    tok = official_template_tokenizers["qwen3"]
    trajs = asyncio.run(trajectories(tok))
    root = tmp_path_factory.mktemp("run")
    write_rollouts(root, 1, [TrajectoryGroup(group_id=0, trajectories=trajs)], tok)
    write_rollouts(root, 2, [TrajectoryGroup(group_id=0, trajectories=trajs[:1])], tok)
    return root, tok, trajs


def terminal(run, **kwargs):
    from rich.console import Console

    buf = io.StringIO()
    shown = show(run, console=Console(file=buf, width=200, force_terminal=False, color_system=None), **kwargs)
    return shown, buf.getvalue()


@pytest.mark.timeout(180)
def test_terminal_shows_every_turn(run_dir):
    root, tok, trajs = run_dir
    shown, text = terminal(root, step=1)
    assert shown == len(trajs)
    flat = flatten(text)
    for traj in trajs:
        for ids, trained in spans(traj):
            for part in parts(tok, ids, trained):
                assert part[:60] in flat.replace("reasoning: ", ""), part
    assert flat.count("loss-masked") == sum(not t for traj in trajs for _, t in spans(traj))
    assert "reasoning: May is half of April." in flat and "policy v3-v4" in flat  # a partial rollout
    assert all(f"reward {traj.reward:g}" in flat for traj in trajs)
    for traj in trajs:  # the composite's terms, as the reward recorded them
        terms = ", ".join(f"{k} {v:g}" for k, v in traj.metadata["reward_terms"].items())
        assert f"reward {traj.reward:g} ({terms})" in flat
    mean = sum(t.reward for t in trajs) / len(trajs)  # the step summary, by hand
    assert f"reward mean {mean:.3f}" in flat and "tool calls 3, errors 1" in flat
    row = json.loads((root / "rollouts" / "step_1.jsonl").read_text().splitlines()[0])
    assert step_summary([row])["policy_version_max"] == 4


@pytest.mark.timeout(180)
def test_filters_and_errors(run_dir):
    root, _, trajs = run_dir
    assert terminal(root, step=1, filter_expr="reward<0.5")[0] == sum(t.reward < 0.5 for t in trajs)
    assert terminal(root, step=1, filter_expr="tool_error")[0] == sum(t.metadata["tool_errors"] > 0 for t in trajs)
    assert terminal(root, step=1, filter_expr="truncated")[0] == 0
    assert terminal(root)[0] == len(trajs) + 1  # both steps
    with pytest.raises(ShowError, match="--step 9: .* has steps 1, 2"):
        terminal(root, step=9)
    with pytest.raises(ShowError, match="--filter"):
        terminal(root, filter_expr="reward~1")
    # a line of the older layout (no turns) still shows
    old = root.parent / "old_run"
    (old / "rollouts").mkdir(parents=True, exist_ok=True)
    row = json.loads((root / "rollouts" / "step_2.jsonl").read_text())
    row.pop("turns"), row.pop("record_version"), row.pop("tool_errors")
    (old / "rollouts" / "step_1.jsonl").write_text(json.dumps(row) + "\n")
    assert "record without turns" in terminal(old)[1]


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browser(tmp_path, url, *args):
    """Headless Chromium on ``url``: its DOM after the page's script ran (``--dump-dom``), or what
    ``args`` ask (a screenshot)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    proc = subprocess.run([chromium(), *flags, *(args or ["--dump-dom"]), url], capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout


def dom_text(dom):
    from html.parser import HTMLParser

    class Text(HTMLParser):
        chunks = []

        def handle_data(self, data):
            self.chunks.append(data)

    reader = Text()
    reader.feed(dom)
    return flatten("".join(reader.chunks))


@pytest.mark.slow  # Chromium (Debian's package: apt-get install chromium), ~20 s
@pytest.mark.timeout(300)
@pytest.mark.skipif(chromium() is None, reason="needs Chromium (apt-get install chromium)")
def test_html_page_in_a_headless_browser(run_dir, tmp_path):
    from PIL import Image
    from rich.console import Console

    root, tok, trajs = run_dir
    page = tmp_path / "run.html"
    show(root, step=1, html_out=page, console=Console(file=io.StringIO()))
    html = page.read_text()
    assert not any(s in html for s in ("http://", "https://", "<link", "src=")), "external assets"
    # sorted by reward (high first), the first trajectory opened, as the query string asks
    dom = browser(tmp_path, page.as_uri() + "?sort=-reward&open=t1-0")
    order = re.findall(r'<details class="traj[^"]*" id="(t1-\d)"', dom)
    assert order == [f"t1-{i}" for i in sorted(range(len(trajs)), key=lambda i: (-trajs[i].reward, i))]
    opened = re.search(r'<details[^>]*id="t1-0"[^>]*>', dom).group(0)
    assert " open" in opened and all(" open" not in m for m in re.findall(r'<details[^>]*id="t1-[12]"[^>]*>', dom))
    text = dom_text(dom)
    for traj in trajs:  # every turn's text, by role
        for ids, trained in spans(traj):
            for part in parts(tok, ids, trained):
                assert part[:60] in text, part
    observations = sum(not t for traj in trajs for _, t in spans(traj))
    assert dom.count('class="turn masked"') == observations and text.count("loss-masked, not trained") == observations
    once = tok.decode(trajs[0].prompt_ids.tolist()).count("<tools>")  # in one prompt's system part
    assert once > 0 and text.count("<tools>") == once  # the system prompt once, not once per trajectory
    for traj in trajs:  # the composite's terms and the gsm8k term's gold answer
        terms = " + ".join(f"{k} {v:g}" for k, v in traj.metadata["reward_terms"].items())
        assert f"reward {traj.reward:g} = {terms} | gold answer: 72" in text
    # filtered: only the trajectories with reward <= 0.5 stay visible
    dom = browser(tmp_path, page.as_uri() + "?max_reward=0.5")
    hidden = re.findall(r'<details class="traj[^"]*" id="t1-\d"[^>]*hidden', dom)
    assert len(hidden) == sum(t.reward > 0.5 for t in trajs)
    assert f"{len(trajs) - len(hidden)} of {len(trajs)} shown" in dom_text(dom)
    # the screenshot of the opened trajectory: trained turns and loss-masked observations look different
    shot = tmp_path / "shot.png"
    browser(tmp_path, page.as_uri() + "?open=t1-0", f"--screenshot={shot}", "--window-size=1400,2400")
    pixels = list(Image.open(shot).convert("RGB").getdata())
    trained_bg, masked_bg = (0xee, 0xf6, 0xff), (0xe4, 0xe4, 0xe4)
    assert pixels.count(trained_bg) > 1000 and pixels.count(masked_bg) > 1000
    shutil.copy(shot, root.parent / "show_screenshot.png")  # kept beside the run for a look


@pytest.mark.timeout(120)
def test_gsm8k_reward_records_its_terms_and_gold(run_dir):
    """The shipped gsm8k reward alone (no composite) explains its value: correct + format_weight * boxed."""
    import asyncio
    import copy

    from megarl.rollout.rewards.gsm8k_answer import Gsm8kReward

    _, _, trajs = run_dir
    reward = Gsm8kReward(executor="inline", format_weight=0.2)
    for traj in trajs:
        traj = copy.deepcopy(traj)
        value = asyncio.run(reward(traj, {"prompt": QUESTION, "answer": "... #### 72"}))
        terms = traj.metadata["reward_terms"]
        assert set(terms) == {"correct", "boxed"} and value == pytest.approx(sum(terms.values()))
        assert terms["boxed"] == pytest.approx(0.2 * ("\\boxed{" in traj.metadata["final_text"]))
        assert traj.metadata["reward_gold"] == "72"
