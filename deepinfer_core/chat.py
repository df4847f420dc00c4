"""Chat messages to prompt token ids, through the tokenizer's chat template (V2/V3 checkpoints)."""

from __future__ import annotations


def check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a prompt either opens a new assistant turn or continues the final message."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt=True and continue_final_message=True: a prompt either opens a new "
                         "assistant turn or continues the final message; pass add_generation_prompt=False to continue it")


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> tuple[str, list[int]]:
    """The text and token ids of ``messages`` ({"role", "content"} dicts) as the chat template
    lays them out (``chat_template``: this Jinja template instead of the tokenizer's), ending
    with the assistant's turn to speak (``add_generation_prompt``) or with the final message
    left open for the model to continue (``continue_final_message``), as vLLM's and transformers'
    arguments of those names; ``tools`` and ``template_kwargs`` go to the template. ValueError
    naming what is wrong: no tokenizer, no template, or messages the template refuses."""
    check_generation_prompt(add_generation_prompt, continue_final_message)
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model's tokenizer has no chat template: give prompts (LLM.generate, /v1/completions) "
                         "instead, or a Jinja template as chat_template")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' and a string 'content', got {m!r:.200}")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as e:  # the template itself refused these messages (jinja raise_exception, a missing key)
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
    """The token ids of ``messages`` as the model's chat template lays them out, ending with the
    assistant's turn to speak (``render_chat``'s ids)."""
    return render_chat(tokenizer, messages, tools, template_kwargs)[1]
