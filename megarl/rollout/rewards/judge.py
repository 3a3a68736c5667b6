"""The ``judge`` reward: a second model scores the policy's answer against a rubric.

The judge is any OpenAI-compatible server: a second SGLang server (``python -m
sglang.launch_server``) or a hosted endpoint. Per trajectory the rubric template is filled with the
sample's question and reference and the policy's final answer, sent to the judge, and the last
``Score: <number>`` of its reply is parsed; the reward is that score mapped from
``[min_score, max_score]`` to ``[0, 1]`` (clipped).

Batching: with ``api: completions`` concurrent calls are coalesced (up to ``max_batch_size`` prompts,
waiting at most ``max_wait_ms``) into one ``/v1/completions`` request whose ``prompt`` is the list
(the rubric then includes any chat markup itself); with ``api: chat`` (default) each call is one
``/v1/chat/completions`` request, at most ``max_concurrency`` in flight, batched by the server's
continuous batching. ``constrain: true`` (SGLang only) adds a ``regex`` so the reply is exactly
``Score: N``; small judges then always produce a parsable score.

Failures are never a silent 0: a request that times out, fails, or returns no parsable score is
retried ``retries`` times (exponential back-off); after that :class:`JudgeError` is raised, which
the rollout manager turns into an ERROR trajectory (logged with the reason, counted in
``rollout/groups_dropped_error``). Counters per step (:meth:`JudgeReward.drain_metrics`):
``judge/calls_sum``, ``judge/http_requests_sum``, ``judge/retries_sum``, ``judge/failures_sum``,
``judge/latency_s_mean``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from megarl.rollout.rewards.keys import FINAL_TEXT_KEY
from megarl.rollout.rewards.reward_registry import register_reward

if TYPE_CHECKING:
    from megarl.rollout.types import Trajectory

logger = logging.getLogger(__name__)

DEFAULT_RUBRIC = """You grade answers to questions.
Question: {question}
Reference answer: {reference}
Answer to grade: {response}
Give a score from 0 (wrong) to 10 (fully correct and concise). Reply exactly as "Score: N"."""

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge gave no usable score after every retry (the message says why)."""


def parse_score(text: str) -> float | None:
    """The number of the last ``Score: N`` in ``text``, or None."""
    found = _SCORE.findall(text)
    return float(found[-1]) if found else None


@dataclass
class _Item:
    prompt: str
    future: asyncio.Future = field(repr=False)


@register_reward("judge")
class JudgeReward:
    """Scores the final answer with a judge model (see the module docstring).

    Args:
        url: the judge server's base URL (``http://host:port``; ``/v1/...`` is appended).
        model: the ``model`` field of requests (SGLang accepts any name).
        api: ``chat`` or ``completions`` (batched).
        rubric: template with ``{question}``, ``{reference}``, ``{response}``.
        question_key, reference_key: sample fields filled into the rubric.
        min_score, max_score: the rubric's scale (mapped to [0, 1]).
        timeout_s: limit of one HTTP request; retries: extra attempts per call.
        max_batch_size, max_wait_ms: coalescing (``completions``); max_concurrency: requests in flight.
        max_tokens, temperature: judge sampling.
        constrain: send ``regex`` ``Score: N`` (SGLang's constrained decoding).
        api_key_env: environment variable holding a bearer token (hosted endpoints), or None.

    Raises:
        ValueError: unknown ``api``, empty ``url``, a rubric without ``{response}``, or
            ``max_score <= min_score``.
    """

    def __init__(self, *, url: str, model: str = "default", api: str = "chat",
                 rubric: str = DEFAULT_RUBRIC, question_key: str = "question",
                 reference_key: str = "answer", min_score: float = 0.0, max_score: float = 10.0,
                 timeout_s: float = 30.0, retries: int = 2, max_batch_size: int = 32,
                 max_wait_ms: float = 5.0, max_concurrency: int = 16, max_tokens: int = 16,
                 temperature: float = 0.0, constrain: bool = False,
                 api_key_env: str | None = None) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"judge: api must be 'chat' or 'completions', got {api!r}")
        if not url:
            raise ValueError("judge: url is empty")
        if "{response}" not in rubric:
            raise ValueError("judge: the rubric must contain {response}")
        if max_score <= min_score:
            raise ValueError(f"judge: max_score {max_score} must exceed min_score {min_score}")
        self.url, self.model, self.api, self.rubric = url.rstrip("/"), model, api, rubric
        self.question_key, self.reference_key = question_key, reference_key
        self.min_score, self.max_score = float(min_score), float(max_score)
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        self.max_batch_size, self.max_wait_s = int(max_batch_size), float(max_wait_ms) / 1000
        self.max_concurrency = int(max_concurrency)
        self.sampling: dict[str, Any] = {"max_tokens": int(max_tokens), "temperature": float(temperature)}
        if constrain:
            hi = int(self.max_score)
            self.sampling["regex"] = f"Score: ({'|'.join(str(i) for i in range(hi, int(self.min_score) - 1, -1))})"
        self.headers = ({"Authorization": f"Bearer {os.environ[api_key_env]}"}
                        if api_key_env and api_key_env in os.environ else {})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._queue: asyncio.Queue[_Item] | None = None
        self._batcher: asyncio.Task | None = None
        self._counts = {"calls": 0, "http_requests": 0, "retries": 0, "failures": 0}
        self._latency_s: list[float] = []

    # -- plumbing -------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the reward may be built outside the loop that calls it
            self._loop = loop
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  headers=self.headers)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._queue = asyncio.Queue()
            self._batcher = loop.create_task(self._run_batches()) if self.api == "completions" else None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None and self._semaphore is not None
        async with self._semaphore:
            self._counts["http_requests"] += 1
            async with self._session.post(self.url + path, json={"model": self.model, **body,
                                                                 **self.sampling}) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    raise JudgeError(f"judge answered HTTP {resp.status}: {str(payload)[:200]}")
                return payload

    async def _chat(self, prompts: list[str]) -> list[str]:
        replies = await asyncio.gather(*(self._post("/v1/chat/completions",
                                                    {"messages": [{"role": "user", "content": p}]})
                                         for p in prompts))
        return [r["choices"][0]["message"]["content"] or "" for r in replies]

    async def _completions(self, prompts: list[str]) -> list[str]:
        reply = await self._post("/v1/completions", {"prompt": prompts})
        texts = [""] * len(prompts)
        for choice in reply["choices"]:
            texts[int(choice["index"])] = choice["text"]
        return texts

    async def score_prompts(self, prompts: list[str]) -> list[float]:
        """Raw judge scores of filled-in rubric prompts, with retries.

        Raises:
            JudgeError: a prompt still has no parsable score after ``retries`` retries.
        """
        self._bind_loop()
        scores: list[float | None] = [None] * len(prompts)
        errors = [""] * len(prompts)
        todo = list(range(len(prompts)))
        for attempt in range(self.retries + 1):
            if attempt:
                self._counts["retries"] += len(todo)
                await asyncio.sleep(0.2 * 2 ** (attempt - 1))
            call = self._completions if self.api == "completions" else self._chat
            try:
                texts = await call([prompts[i] for i in todo])
            except (TimeoutError, aiohttp.ClientError, JudgeError, KeyError, ValueError) as e:
                for i in todo:
                    errors[i] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            for i, text in zip(todo, texts):
                scores[i] = parse_score(text)
                errors[i] = "" if scores[i] is not None else f"no 'Score: N' in the reply {text[:100]!r}"
            todo = [i for i in todo if scores[i] is None]
            if not todo:
                break
        if todo:
            self._counts["failures"] += len(todo)
            raise JudgeError(f"judge at {self.url} failed after {self.retries + 1} attempts: {errors[todo[0]]}")
        return [float(s) for s in scores]  # type: ignore[arg-type]

    async def _run_batches(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(),
                                                        max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    break
            asyncio.get_running_loop().create_task(self._score_batch(batch))

    async def _score_batch(self, batch: list[_Item]) -> None:
        try:
            scores = await self.score_prompts([item.prompt for item in batch])
        except JudgeError:  # retry one by one: one bad reply must not fail its batch-mates
            for item in batch:
                try:
                    item.future.set_result((await self.score_prompts([item.prompt]))[0])
                except JudgeError as e:
                    item.future.set_exception(e)
            return
        for item, score in zip(batch, scores):
            item.future.set_result(score)

    # -- reward ---------------------------------------------------------------------------------
    def prompt_for(self, trajectory: Trajectory, sample: dict[str, Any]) -> str:
        """The judge's prompt for one trajectory: the rubric filled with the sample's question, its
        reference answer (a list joined with `` / ``) and the policy's final text.
        """
        reference = sample.get(self.reference_key, "")
        if isinstance(reference, (list, tuple)):
            reference = " / ".join(map(str, reference))
        return self.rubric.format(question=sample.get(self.question_key, ""), reference=reference,
                                  response=trajectory.metadata.get(FINAL_TEXT_KEY, ""))

    async def __call__(self, trajectory: Trajectory, sample: dict[str, Any]) -> float:
        """The judge's score in [0, 1].

        Raises:
            JudgeError: no usable score (logged and counted; never a silent 0).
        """
        self._bind_loop()
        self._counts["calls"] += 1
        start = time.monotonic()
        prompt = self.prompt_for(trajectory, sample)
        try:
            if self.api == "completions":
                future = asyncio.get_running_loop().create_future()
                await self._queue.put(_Item(prompt, future))  # type: ignore[union-attr]
                score = await future
            else:
                score = (await self.score_prompts([prompt]))[0]
        except JudgeError as e:
            logger.warning("judge failure (counted in judge/failures_sum): %s", e)
            raise
        self._latency_s.append(time.monotonic() - start)
        span = self.max_score - self.min_score
        return min(1.0, max(0.0, (score - self.min_score) / span))

    def drain_metrics(self) -> dict[str, float]:
        """``judge/*`` counters since the last call (then reset)."""
        out = {f"judge/{k}_sum": float(v) for k, v in self._counts.items()}
        out["judge/latency_s_mean"] = sum(self._latency_s) / len(self._latency_s) if self._latency_s else 0.0
        self._counts = dict.fromkeys(self._counts, 0)
        self._latency_s = []
        return out

    async def close(self) -> None:
        """Stop the batching task and close the HTTP session."""
        if self._batcher is not None:
            self._batcher.cancel()
        if self._session is not None and not self._session.closed:
            await self._session.close()
