"""Chat messages to prompt token ids, through the tokenizer's chat template (V2/V3 checkpoints)."""

from __future__ import annotations


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The token ids of ``messages`` ({"role", "content"} dicts) as the model's chat template lays
    them out, ending with the assistant's turn to speak (``tools`` and ``template_kwargs`` passed
    to the template). ValueError naming what is wrong: no tokenizer, no template, or messages the
    template refuses."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: give prompts (LLM.generate, /v1/completions) instead")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' and a string 'content', got {m!r:.200}")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as e:  # the template itself refused these messages (jinja raise_exception, a missing key)
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens
