"""A request body's prompt prefix as routing keys (host only, no tokenizer): what the Ray Serve
router (server/ray_serve_router.py) remembers routes by."""

from __future__ import annotations

import hashlib
import json

PREFIX_CHARS = (256, 1024, 4096)  # the prompt text's prefixes a route is remembered by
ROUTES_KEPT = 1 << 16


def prompt_text(body: bytes) -> str:
    """The text a request's prompt starts with, as far as the body says (no tokenizer here):
    a chat's messages in order, or a completion's prompt (token ids as text)."""
    try:
        obj = json.loads(body)
    except (ValueError, TypeError):
        return ""
    if not isinstance(obj, dict):
        return ""
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        return "".join(f"{m.get('role')}\x00{m.get('content')}\x00" for m in msgs
                       if isinstance(m, dict))
    prompt = obj.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_keys(body: bytes) -> list[str]:
    """Hashes of the prompt's text at PREFIX_CHARS lengths it reaches (shortest first)."""
    text = prompt_text(body)
    return [hashlib.blake2b(text[:n].encode(), digest_size=12).hexdigest()
            for n in PREFIX_CHARS if len(text) >= n]
