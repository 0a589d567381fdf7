"""A model's own chat template: the Jinja program that turns messages into its prompt.

Instruct models are trained on one exact prompt layout (Llama 3's ``<|start_header_id|>``
headers, ChatML's ``<|im_start|>``...); the checkpoint ships it as Jinja source in
``chat_template.jinja``, in ``tokenizer_config.json`` (``chat_template``: a string, or a list of
named templates) or in GGUF metadata (``tokenizer.chat_template``). Templates are untrusted code
from a model hub, so they run in Jinja's immutable sandbox, with the globals and filters that
transformers gives them (``raise_exception``, ``strftime_now``, a ``tojson`` that does not
HTML-escape, ``namespace``/``dict`` that refuse underscore names), which is what makes the
prompt equal to ``apply_chat_template``'s byte for byte.

Generation has to stop where the model ends its turn, which for most instruct models is not the
tokenizer's EOS (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``). The template
itself says which token that is: render an assistant turn and read what follows its content.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lowband.errors import ChatTemplateError, ConfigError

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_NAME = "default"  # the template picked from a list of named ones (as transformers does)
TOOL_USE_NAME = "tool_use"  # ... unless the request carries tools and the model has this one
# The arguments every render passes; a caller's extra template kwargs may not shadow them.
RESERVED_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
)
_PROBE = "LOWBANDPROBE7c1e"  # assistant content of the end-of-turn probe (survives `| trim`)
_TAG = re.compile(r"<[^<>\s]{1,48}>")  # a marker like <|im_end|> when the vocabulary is unknown


# ---- the sandbox ---------------------------------------------------------------------------------
def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"the model's chat template refused these messages: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own filter HTML-escapes (<, >, &, ') and has no ensure_ascii: templates were
    # written against transformers' filter, which is plain json.dumps.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not store the underscore-prefixed attribute {name!r}"
        )


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses dunder/underscore attributes (no path to internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Dict:
    """``dict(...)`` without exposing the ``dict`` type itself to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens for
    training masks with it); serving only needs the text inside."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


# ---- messages ------------------------------------------------------------------------------------
def _content(m: Mapping[str, Any]) -> str | None:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return None  # an assistant turn that only calls tools
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in c
    ):
        return "\n".join(p["text"] for p in c)  # OpenAI content parts (text only)
    raise ChatTemplateError(
        "each message's content must be a string or a list of {'type': 'text', 'text': ...} "
        f"parts, got {type(c).__name__}"
    )


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI ``messages`` list; return plain dicts a template can read: text parts
    joined, keys whose value is null dropped (templates test presence, not null, as
    transformers' ``apply_chat_template`` does). Raises :class:`ChatTemplateError`."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatTemplateError(
                f"messages[{i}] needs a role in {'/'.join(ROLES)} and content, "
                f"got {m if not isinstance(m, dict) else m.get('role')!r}"
            )
        plain = {k: v for k, v in m.items() if v is not None}
        content = _content(m)
        if content is not None:
            plain["content"] = content
        out.append(plain)
    return out


# ---- the template --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A model's chat template and the tokens that frame its turns."""

    source: str
    """The Jinja source (the default one of a list of named templates)."""
    named: Mapping[str, str] = field(default_factory=dict)
    """Every named template the checkpoint ships (``tool_use`` is picked when tools are sent)."""
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    stop_strings: tuple[str, ...] = ()
    """End-of-turn token texts: a tokenizer that spells them as text still stops on them."""
    stop_token_ids: tuple[int, ...] = ()
    """End-of-turn and EOS ids (the vocabulary's, and generation_config.json's)."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ConfigError("chat_template", "is empty")

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt for ``messages`` (already :func:`normalize_messages`-d), ending with the
        assistant's header when ``add_generation_prompt``. ``kwargs`` reach the template as
        variables (e.g. ``enable_thinking``, ``date_string``). Raises :class:`ChatTemplateError`."""
        clash = RESERVED_KWARGS.intersection(kwargs)
        if clash:
            raise ChatTemplateError(f"template kwargs may not set {sorted(clash)}")
        source = self.named.get(TOOL_USE_NAME, self.source) if tools else self.source
        template = _compile(source)
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        # What a template does wrong on odd input (a list where it adds strings, a missing key
        # it indexes): the request's fault, answered with the template's own message.
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
            raise ChatTemplateError(
                f"the model's chat template failed on these messages: {exc}"
            ) from None

    def encode(self, encode: Callable[[str], list[int]], text: str) -> list[int]:
        """Tokenise a rendered prompt. A template that writes ``bos_token`` itself, fed to a
        tokenizer that also adds BOS, would start with two; drop the tokenizer's (transformers
        tokenises rendered chats with ``add_special_tokens=False`` for the same reason)."""
        ids = encode(text)
        b = self.bos_token_id
        if (
            b is not None
            and self.bos_token
            and text.startswith(self.bos_token)
            and ids[:2] == [b, b]
        ):
            ids = ids[1:]
        return ids


def end_of_turn_tokens(
    source: str,
    *,
    bos_token: str | None,
    eos_token: str | None,
    vocabulary: Mapping[str, int],
) -> tuple[str, ...]:
    """The token(s) a template writes right after an assistant message's content: render a
    one-turn chat and read the text that follows the reply. ``vocabulary``: the special tokens
    by text; without one, a ``<...>`` marker is taken as the token."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = _compile(source).render(
            messages=probe,
            add_generation_prompt=False,
            tools=None,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except (ChatTemplateError, jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
        logger.debug("end-of-turn probe failed: %s", exc)
        return ()
    at = text.rfind(_PROBE)
    if at < 0:
        return ()
    after = text[at + len(_PROBE) :].lstrip(" ")
    known = [t for t in (*vocabulary, eos_token) if t and after.startswith(t)]
    if known:
        return (max(known, key=len),)
    tag = _TAG.match(after)
    return (tag.group(0),) if tag else ()


def build_chat_template(
    source: str | Mapping[str, str],
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    vocabulary: Mapping[str, int] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> ChatTemplate:
    """A :class:`ChatTemplate` from its source (or named sources) and the tokenizer's special
    tokens; finds the end-of-turn token and resolves every stop text to its id."""
    named: dict[str, str] = {}
    if isinstance(source, Mapping):
        named = dict(source)
        if DEFAULT_NAME not in named:
            raise ConfigError(
                "chat_template",
                f"a list of named templates needs one named {DEFAULT_NAME!r}, got {sorted(named)}",
            )
        main = named[DEFAULT_NAME]
    else:
        main = source
    _compile(main)  # a template that does not parse is refused at load, not per request
    vocab = dict(vocabulary or {})
    eot = end_of_turn_tokens(main, bos_token=bos_token, eos_token=eos_token, vocabulary=vocab)
    stops = tuple(dict.fromkeys([*eot, *([eos_token] if eos_token else [])]))
    ids = [vocab[s] for s in stops if s in vocab] + [int(i) for i in eos_token_ids]
    return ChatTemplate(
        source=main,
        named=named,
        bos_token=bos_token,
        eos_token=eos_token,
        bos_token_id=vocab.get(bos_token) if bos_token else None,
        stop_strings=stops,
        stop_token_ids=tuple(dict.fromkeys(ids)),
    )


def template_from_gguf_metadata(
    value: str,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    vocabulary: Mapping[str, int] | None = None,
    eos_token_ids: Sequence[int] = (),
) -> ChatTemplate:
    """The template of a GGUF file's ``tokenizer.chat_template`` metadata (a string); the GGUF
    reader passes the BOS/EOS texts and the special tokens of ``tokenizer.ggml.tokens``."""
    if not isinstance(value, str):
        raise ConfigError("tokenizer.chat_template", f"must be a string, got {type(value)}")
    return build_chat_template(
        value,
        bos_token=bos_token,
        eos_token=eos_token,
        vocabulary=vocabulary,
        eos_token_ids=eos_token_ids,
    )


# ---- a checkpoint directory ----------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(path.name, f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as its text or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _added_tokens(d: Path, config: Mapping[str, Any]) -> Iterator[tuple[str, int]]:
    for t in _read_json(d / "tokenizer.json").get("added_tokens", ()):
        if isinstance(t, dict) and isinstance(t.get("content"), str):
            yield t["content"], int(t["id"])
    for i, t in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(t, dict) and isinstance(t.get("content"), str):
            yield t["content"], int(i)


def _template_source(d: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    src = config.get("chat_template")
    if isinstance(src, list):  # [{"name": ..., "template": ...}, ...]
        try:
            return {str(t["name"]): str(t["template"]) for t in src}
        except (KeyError, TypeError):
            raise ConfigError(
                "chat_template", "a list of templates needs {'name', 'template'} entries"
            ) from None
    if src is not None and not isinstance(src, str):
        raise ConfigError("chat_template", f"must be a string or a list, got {type(src)}")
    return src or None


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template a checkpoint directory ships (``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template``), or None: a base model has none."""
    d = Path(model_dir)
    config = _read_json(d / "tokenizer_config.json")
    source = _template_source(d, config)
    if source is None:
        return None
    gen = _read_json(d / "generation_config.json").get("eos_token_id")
    eos_ids = gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else []
    return build_chat_template(
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        vocabulary=dict(_added_tokens(d, config)),
        eos_token_ids=[i for i in eos_ids if isinstance(i, int)],
    )
