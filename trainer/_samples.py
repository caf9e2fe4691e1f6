"""Training samples from captured calls, built from token ids only, and their packing.

A trajectory is the ordered list of its calls. Consecutive calls become one sample
when the next prompt starts with everything merged so far (prompts and completions)
token for token; the new prompt's extra tokens (a tool result, the next user turn,
chat-template tokens) join with ``loss_mask`` False and the new completion with True.
Otherwise the sample ends and a new one starts: a *mismatch*. Mismatches are normal,
not errors: vLLM's completion ids end with the stop token (``<|im_end|>``) while the
chat template re-renders the assistant turn from text, and may spell it differently
(reasoning stripped, tool calls re-serialized). They are counted so a user sees when
an agent's template keeps breaking the merge, with why each split happened:

- ``split_rerendered``: the new prompt keeps everything before the last completion but not
  the completion's own ids: the template re-rendered the previous turn (the common case);
- ``split_not_extended``: the new prompt does not even keep what came before it (the agent
  dropped, edited or summarized earlier turns, or started another conversation).

A re-rendered turn that reads the same as the model wrote it, in other token ids, still merges when
``build_samples`` is given the model's ``decode``: constrained decoding (``tool_choice`` "required")
samples non-canonical splits such as ``}`` ``}`` that the template's text tokenizes as ``}}``; a
client that dropped the blanks the answer opened with (a Hermes-style parser's ``"\n\n"`` before a
tool call, which Anthropic's clients strip) leaves a turn that reads the same but for them. The
sample keeps the ids as sampled (their logprobs are the sampler's) and continues with the rest of the
new prompt (``merged_retokenized``). The next completion was sampled after the canonical ids, so the
learner scores it in a context that reads the same but is spelled in other ids: a small gap the step
measures (``logprob_mismatch``) and the sampler correction bounds, against forwarding the whole
conversation again as a new sample.

Each split is what a token budget sees: ``call_tokens`` (every call's prompt plus completion, as
captured) against ``tokens`` (the samples' tokens, each shared prefix counted in every sample that
has it) and ``loss_tokens`` (what carries loss). The learner lays the split samples of a trajectory
as one prefix tree (``trainer._prefix_tree``), so the prefix they share is forwarded once.

Calls that cannot train are skipped and counted: failed (status != 200), inconsistent
(logprobs not one per completion token, or an empty prompt: the first token of a
sample has no logit to score it), and empty completions.

Each sampled token keeps the temperature its call was sampled at: the trainer scores it
with ``log_softmax(logits / T)``, the distribution vLLM sampled from and whose logprob
it returned (``--logprobs-mode processed_logprobs``). A greedy call (T below vLLM's
1e-5) sampled nothing: its completion joins the sample as context without loss (so the
next call still merges) and is counted (``skipped_greedy``); a sample left with no
sampled token is dropped. Calls sampled with top-p, top-k or min-p are counted
(``truncated``): vLLM's logprob is renormalized over the tokens it kept, the trainer's is
not, so their ratio sits below 1 by the probability mass that truncation cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

# vLLM samples greedily below this temperature (its _SAMPLING_EPS); such a call's logprobs are not a sampler's.
GREEDY_BELOW = 1e-5
# How many tokens at the end of a prompt may open the answer (a reasoning template's "<think>\n") and be left out
# when the template renders that turn as history: such a split still counts as the template's re-rendering.
OPENING_TOKENS = 4

# Token ids to text, special tokens kept (the model's tokenizer): what lets a re-tokenized turn merge.
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class CapturedCall:
    """One call as the proxy recorded it: the tokens vLLM saw and sampled."""

    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]  # includes the stop token when vLLM sampled one
    logprobs: Sequence[float]  # sampling logprob of each completion token
    status_code: int = 200
    version: int = 0  # the policy version that served the call
    temperature: float = 1.0  # the sampling temperature vLLM applied (the request's, else the server default)
    truncated: bool = False  # sampled with top-p < 1, top-k > 0 or min-p > 0
    # The structured-output specification vLLM sampled the completion under (JSON; trainer._grammar), or None.
    structured_outputs: str | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence: prompts and completions of one or more merged calls."""

    token_ids: list[int]
    loss_mask: list[bool]  # True only on sampled tokens
    old_logprobs: list[float]  # vLLM's sampling logprob per token; 0.0 where loss_mask is False
    n_calls: int
    oldest_version: int  # the oldest policy version that sampled any of its tokens (for staleness)
    # The sampling temperature of each token; 1.0 where loss_mask is False. Empty: every token at 1.0.
    temperatures: list[float] = field(default_factory=list)
    # The constrained completions in it: (start, end, specification), tokens [start, end) sampled under that
    # grammar (trainer._grammar); the learner masks their logits as vLLM did. Empty: nothing constrained.
    grammars: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def constrained_tokens(self) -> int:
        return sum(end - start for start, end, _ in self.grammars)


@dataclass(frozen=True, slots=True)
class SampleStats:
    """What `build_samples` did with the calls; add them up over trajectories with ``+``."""

    trajectories: int = 0  # trajectories built (one per build_samples call)
    calls: int = 0
    merged: int = 0  # calls appended to the sample before them
    merged_retokenized: int = 0  # ...of which across a turn the template re-rendered to the same text in other ids
    mismatched: int = 0  # calls that started a new sample although one was open: the two splits below
    split_rerendered: int = 0  # ...whose prompt re-rendered the previous completion (the template's doing)
    split_not_extended: int = 0  # ...whose prompt dropped or changed what came before the previous completion
    samples: int = 0
    loss_tokens: int = 0
    tokens: int = 0  # tokens the samples forward (prompts included)
    call_tokens: int = 0  # prompt plus completion tokens of every call, as captured
    completion_tokens: int = 0  # completion tokens of every call, as captured (what could carry loss)
    skipped_failed: int = 0  # status != 200
    skipped_inconsistent: int = 0  # logprobs length != completion length, or empty prompt
    skipped_empty: int = 0  # no completion tokens
    skipped_greedy: int = 0  # temperature 0: the completion is context, not loss (its logprobs are not a sampler's)
    truncated: int = 0  # trained calls sampled with top-p/top-k/min-p (their ratio is biased below 1)
    constrained: int = 0  # trained calls sampled under a grammar (structured outputs): scored under it

    def __add__(self, other: SampleStats) -> SampleStats:
        return SampleStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(slots=True)
class _Open:
    """The sample being built."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    grammars: list[tuple[int, int, str]] = field(default_factory=list)
    n_calls: int = 0
    n_trained: int = 0  # calls whose completion carries loss
    oldest_version: int = 0
    context_len: int = 0  # tokens before the last call's completion

    def extends(self, prompt: list[int]) -> bool:
        n = len(self.token_ids)
        return len(prompt) >= n and prompt[:n] == self.token_ids

    def keeps_context(self, prompt: list[int]) -> bool:
        """The prompt starts with everything before the last completion."""
        n = self.context_len
        return len(prompt) >= n and prompt[:n] == self.token_ids[:n]

    def rerendered(self, prompt: list[int]) -> bool:
        """The prompt keeps what came before the last completion (but for the answer's opening), not the completion."""
        n = self.context_len - min(OPENING_TOKENS, self.context_len // 2)
        return len(prompt) >= n and prompt[:n] == self.token_ids[:n]

    def retokenized_end(self, prompt: list[int], decode: Decode) -> int | None:
        """Where the re-rendered last completion ends in ``prompt``, if it reads the same as sampled; else None.

        The completion ends with its stop token (``<|im_end|>``), which the template writes after the turn
        too: the re-rendered turn is the prompt from ``context_len`` to that token's first occurrence.
        """
        completion = self.token_ids[self.context_len :]
        if not completion or not self.keeps_context(prompt):
            return None
        try:
            end = prompt.index(completion[-1], self.context_len) + 1
        except ValueError:
            return None
        rendered, sampled = decode(prompt[self.context_len : end]), decode(completion)
        # Blanks the answer opened with may be gone: a tool parser's "\n\n" before a call is text of its own,
        # which Anthropic's clients drop before they send the history back (Anthropic's API refuses it).
        same = rendered == sampled or rendered.lstrip() == sampled.lstrip()
        return end if same else None

    def append(self, call: CapturedCall, new_prompt: list[int], *, sampled: bool = True) -> None:
        """The call's new prompt tokens as context, then its completion: loss only if ``sampled``."""
        self.token_ids += new_prompt
        self.loss_mask += [False] * len(new_prompt)
        self.old_logprobs += [0.0] * len(new_prompt)
        self.temperatures += [1.0] * len(new_prompt)
        self.context_len = len(self.token_ids)
        n = len(call.completion_token_ids)
        if sampled and call.structured_outputs is not None:
            self.grammars.append((len(self.token_ids), len(self.token_ids) + n, call.structured_outputs))
        self.token_ids += call.completion_token_ids
        self.loss_mask += [sampled] * n
        self.old_logprobs += [float(x) for x in call.logprobs] if sampled else [0.0] * n
        self.temperatures += [float(call.temperature) if sampled else 1.0] * n
        if sampled:
            self.oldest_version = call.version if self.n_trained == 0 else min(self.oldest_version, call.version)
            self.n_trained += 1
        self.n_calls += 1

    def close(self) -> Sample | None:
        """The sample, or None when no call of it was sampled (only greedy ones): nothing to train."""
        if self.n_trained == 0:
            return None
        return Sample(self.token_ids, self.loss_mask, self.old_logprobs, self.n_calls, self.oldest_version,
                      self.temperatures, self.grammars)  # fmt: skip


def build_samples(calls: Sequence[CapturedCall], decode: Decode | None = None) -> tuple[list[Sample], SampleStats]:
    """Merge one trajectory's calls, in order, into training samples (across re-tokenized turns with ``decode``).

    >>> first = CapturedCall([1, 2], [3, 4], [-0.1, -0.2])
    >>> second = CapturedCall([1, 2, 3, 4, 5], [6], [-0.3])  # 5: a tool result
    >>> samples, stats = build_samples([first, second])
    >>> samples[0].token_ids, samples[0].loss_mask, stats.merged
    ([1, 2, 3, 4, 5, 6], [False, False, True, True, False, True], 1)
    """
    samples: list[Sample] = []
    failed = inconsistent = empty = greedy = truncated = merged = retokenized = rerendered = not_extended = 0
    constrained = 0
    current: _Open | None = None

    def close(sample: _Open | None) -> None:
        closed = sample.close() if sample is not None else None
        if closed is not None:
            samples.append(closed)

    for call in calls:
        if call.status_code != 200:
            failed += 1
            continue
        if len(call.logprobs) != len(call.completion_token_ids) or not call.prompt_token_ids:
            inconsistent += 1
            continue
        if not call.completion_token_ids:
            empty += 1
            continue
        sampled = call.temperature >= GREEDY_BELOW
        greedy += not sampled
        truncated += sampled and call.truncated
        constrained += sampled and call.structured_outputs is not None
        prompt = list(call.prompt_token_ids)
        if current is not None and current.extends(prompt):
            current.append(call, prompt[len(current.token_ids) :], sampled=sampled)
            merged += 1
            continue
        end = current.retokenized_end(prompt, decode) if current is not None and decode is not None else None
        if current is not None and end is not None:
            current.append(call, prompt[end:], sampled=sampled)
            merged += 1
            retokenized += 1
            continue
        if current is not None:
            rerendered += current.rerendered(prompt)
            not_extended += not current.rerendered(prompt)
            close(current)
        current = _Open()
        current.append(call, prompt, sampled=sampled)
    close(current)

    stats = SampleStats(
        trajectories=1 if calls else 0,
        calls=len(calls),
        merged=merged,
        merged_retokenized=retokenized,
        mismatched=rerendered + not_extended,
        split_rerendered=rerendered,
        split_not_extended=not_extended,
        samples=len(samples),
        loss_tokens=sum(s.loss_tokens for s in samples),
        tokens=sum(len(s.token_ids) for s in samples),
        call_tokens=sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in calls),
        completion_tokens=sum(len(c.completion_token_ids) for c in calls),
        skipped_failed=failed,
        skipped_inconsistent=inconsistent,
        skipped_empty=empty,
        skipped_greedy=greedy,
        truncated=truncated,
        constrained=constrained,
    )
    return samples, stats


def pack(samples: Sequence[Sample], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens each.

    First-fit decreasing: longest samples first, each into the first micro-batch with
    room. A sample is never split; one longer than ``max_tokens`` gets a micro-batch of
    its own (the forward then exceeds the budget; the caller decides whether to allow
    that). Indices within a micro-batch are ascending; the result is deterministic.

    >>> lengths = [3, 5, 2, 4]
    >>> pack([Sample([0] * n, [True] * n, [0.0] * n, 1, 0) for n in lengths], 7)
    [[1, 2], [0, 3]]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids))  # stable: ties keep input order
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(samples[i].token_ids)
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]
