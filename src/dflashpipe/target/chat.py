"""The target's chat template, rendered exactly as transformers renders it, and where its replies lie.

The loss mask comes from the rendering, never from guessing token ids. Each sample is
rendered once with the template (exactly as `apply_chat_template(tokenize=False)`
renders it) and encoded once with the fast tokenizer, with character offsets. Where
each assistant reply lies in that text is learnt from a *skeleton*: the same template
rendered once per role sequence with a unique sentinel as every message's content.
The skeleton's literal pieces interleaved with the real contents must rebuild the real
rendering exactly; then each reply's characters are known, and a token is supervised
when its characters overlap a reply or the reply's end-of-turn token (the first special
token the template writes after the reply). A template that rewrites contents (say
`| trim`) fails that check, and the sample falls back to prefix renders: the reply
starts where `messages[:i]` + generation prompt ends. Because positions come from the
template and not from searching the text, a user turn that contains the literal
`<|im_start|>assistant` is never supervised.

Every rendering passes target.chat_template_kwargs (Qwen3's `enable_thinking`, say) to the template, so the
prompts regenerate answers, the text tokenize trains on and the prompts evaluate and serve decode are one
rendering. A kwarg the template does not read is refused when the tokenizer is loaded, before any work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashpipe.core.errors import ParamsError, SourceError

KWARGS_KEY = "target.chat_template_kwargs"
RENDER_SETS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""The variables transformers' render_jinja_template passes itself (the special tokens besides): no kwarg sets them."""
SENTINEL = "\ue000{}\ue001"
"""Private-use characters around a message index: no template writes them itself."""


class TokenizerError(SourceError):
    """The target's tokenizer is missing, or cannot render chats."""


@dataclass
class ChatTokenizer:
    """The target's fast tokenizer, its chat template and what the template is rendered with."""

    tokenizer: Any
    """The transformers tokenizer, for decoding and for `apply_chat_template` comparisons."""
    template: str
    template_kwargs: dict[str, Any]
    """The special tokens, then target.chat_template_kwargs: every variable a rendering passes."""
    special: re.Pattern
    """Matches any special added token: the candidates for a reply's end-of-turn token."""
    chosen_kwargs: dict[str, Any] = field(default_factory=dict)
    """target.chat_template_kwargs alone, as a record names them."""

    def __post_init__(self) -> None:
        self.backend = self.tokenizer.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()

    def render(self, conversation: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The text `apply_chat_template(conversation, tokenize=False)` gives, from the same function."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[conversation],
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return rendered[0]

    def generation_prompt(
        self, ids: list[int], through: str, turns: list[dict[str, str]]
    ) -> tuple[list[int], str, bool]:
        """The ids the target reads before answering after `turns`, their text (the generation prompt), and whether
        they extend `ids`.

        `ids` is the sequence so far (the last prompt and reply, as the target read and wrote them) and `through`
        its text. Where the generation prompt starts with `through`, it extends `ids` by its text after it, encoded;
        where the template renders the earlier turns otherwise than the target read them (Qwen3 drops the think
        block it opened after an earlier generation prompt), it is encoded whole and the sequence starts again.
        regenerate asks with these ids and tokenize builds its rows with them: one rule for both."""
        text = self.render(turns, add_generation_prompt=True)
        encode = self.backend.encode
        if ids and text.startswith(through):
            return ids + encode(text[len(through) :], add_special_tokens=False).ids, text, True
        return encode(text, add_special_tokens=False).ids, text, False


def load_chat_tokenizer(target_dir: Path | str, template_kwargs: dict[str, Any] | None = None) -> ChatTokenizer:
    """The target's tokenizer and template, rendering with `template_kwargs` (target.chat_template_kwargs)."""
    target_dir = Path(target_dir)
    tokenizer_json = target_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerError(
            f"{tokenizer_json} not found: tokenize needs the target's fast tokenizer; run `dvc repro target` "
            f"(a target given as a model directory must ship tokenizer.json)"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise TokenizerError(f"{tokenizer_json}: cannot load the tokenizer: {exc}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(f"{tokenizer_json}: not a fast tokenizer; tokenize needs character offsets")
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        template = None
    if not template:
        where = target_dir / "chat_template.jinja"
        raise TokenizerError(
            f"{where} not found and {target_dir / 'tokenizer_config.json'} has no chat_template: samples are "
            f"rendered with the target's own template, so use an instruct/chat target"
        )
    passed = dict(tokenizer.special_tokens_map)
    chosen = dict(template_kwargs or {})
    reads, inputs = (names - RENDER_SETS - set(passed) for names in template_variables(template))
    unread = sorted(set(chosen) - reads)
    if unread:
        where = target_dir / "chat_template.jinja"
        where = where if where.is_file() else target_dir / "tokenizer_config.json"
        raise ParamsError(
            f"params.yaml: {KWARGS_KEY} names {unread}, which the chat template in {where} does not read "
            f"(it reads {sorted(inputs) or 'nothing besides the chat'}): remove them"
        )
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return ChatTokenizer(
        tokenizer,
        template,
        passed | chosen,
        re.compile("|".join(map(re.escape, specials)) or "(?!)"),
        chosen,
    )


def template_variables(template: str) -> tuple[set[str], set[str]]:
    """What `template` may read from outside, as transformers parses it (its environment: the `generation` tag, the
    globals such as `raise_exception`): jinja2.meta's undeclared names, which also hold names the template sets
    only inside a branch; and of those, the ones to show a user: never set by the template, or tested with `is
    defined` (an input it gives a default, as Llama 3's `date_string`)."""
    from jinja2 import meta, nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(template).environment
    tree = environment.parse(template)
    reads = meta.find_undeclared_variables(tree) - set(environment.globals)
    sets = {n.name for n in tree.find_all(nodes.Name) if n.ctx == "store"}
    tested = {t.node.name for t in tree.find_all(nodes.Test) if t.name == "defined" and isinstance(t.node, nodes.Name)}
    return reads, reads - (sets - tested)


class ReplyLocator:
    """Character spans of the assistant replies (each with its end-of-turn token) in a rendering."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self.skeletons: dict[tuple[str, ...], list[str] | None] = {}
        self.as_read: dict[tuple[str, ...], bool] = {}

    def reads_as_prompted(self, roles: tuple[str, ...]) -> bool:
        """Whether the rendering puts each reply right after the generation prompt the target answered it after
        (ChatML: yes; Qwen3 with enable_thinking false: no, its history drops the think block its generation prompt
        opens). Learnt once per role sequence from the skeleton; a template the skeleton cannot read: no."""
        if roles not in self.as_read:
            pieces = self._skeleton(roles)
            turns = [{"role": r, "content": SENTINEL.format(j)} for j, r in enumerate(roles)]
            self.as_read[roles] = pieces is not None and all(
                self._prompt_is(
                    turns[:a], "".join(p + t["content"] for p, t in zip(pieces[:a], turns[:a], strict=True)) + pieces[a]
                )
                for a, role in enumerate(roles)
                if role == "assistant"
            )
        return self.as_read[roles]

    def _prompt_is(self, turns: list[dict[str, str]], text: str) -> bool:
        """The generation prompt after `turns` is `text`; a template with no generation prompt (it renders the same
        without) has only its rendering to be read by, so it counts as read as rendered."""
        try:
            prompt = self.chat.render(turns, add_generation_prompt=True)
            return prompt == text or prompt == self.chat.render(turns)
        except template_errors():
            return False

    def spans(self, conversation: list[dict[str, str]], text: str) -> tuple[list[tuple[int, int]], str] | None:
        """The spans and how they were found (`skeleton` or `prefix`); None if the template hides a reply."""
        pieces = self._skeleton(tuple(turn["role"] for turn in conversation))
        if pieces is not None:
            parts, spans, pos = [], [], 0
            for j, turn in enumerate(conversation):
                parts += (pieces[j], turn["content"])
                start = pos + len(pieces[j])
                pos = start + len(turn["content"])
                if turn["role"] == "assistant":
                    spans.append((start, pos + self.end_of_turn(pieces[j + 1], 0)))
            parts.append(pieces[-1])
            if "".join(parts) == text:
                return spans, "skeleton"
        spans = self._by_prefix(conversation, text)
        return None if spans is None else (spans, "prefix")

    def _skeleton(self, roles: tuple[str, ...]) -> list[str] | None:
        """The template's literal text between the messages' contents, for this role sequence."""
        if roles in self.skeletons:
            return self.skeletons[roles]
        pieces: list[str] | None = []
        try:
            rendered = self.chat.render([{"role": r, "content": SENTINEL.format(j)} for j, r in enumerate(roles)])
        except template_errors():
            rendered = None
        pos = 0
        for j in range(len(roles)):
            sentinel = SENTINEL.format(j)
            at = -1 if rendered is None else rendered.find(sentinel, pos)
            if at < 0 or rendered.count(sentinel) != 1:
                pieces = None
                break
            pieces.append(rendered[pos:at])
            pos = at + len(sentinel)
        if pieces is not None:
            pieces.append(rendered[pos:])
        self.skeletons[roles] = pieces
        return pieces

    def _by_prefix(self, conversation: list[dict[str, str]], text: str) -> list[tuple[int, int]] | None:
        spans = []
        for i, turn in enumerate(conversation):
            if turn["role"] != "assistant":
                continue
            try:
                head = self.chat.render(conversation[:i], add_generation_prompt=True)
                through = self.chat.render(conversation[: i + 1])
            except template_errors():
                return None
            if not (through.startswith(head) and text.startswith(through)):
                return None
            reply = through[len(head) :]
            content = turn["content"]
            shown = next(
                (c for c in (content, content.strip(), content.rstrip(), content.lstrip()) if reply.startswith(c)), ""
            )
            end = self.end_of_turn(reply, len(shown))
            spans.append((len(head), len(head) + (end if end > len(shown) else len(reply))))
        return spans

    def end_of_turn(self, text: str, after: int) -> int:
        """Where the end-of-turn token after `after` ends: the first special token, if only
        whitespace precedes it; else `after` (the reply has no end-of-turn token)."""
        match = self.chat.special.search(text, after)
        if match is None or text[after : match.start()].strip():
            return after
        return match.end()


def template_errors() -> tuple[type[BaseException], ...]:
    """What rendering a template can raise for one sample's content (jinja2 imported only when rendering)."""
    import jinja2

    return (jinja2.TemplateError,)
