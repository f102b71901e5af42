"""A multi-turn rollout with a calculator tool:

    relax rollout.generate_fn=relax.rollout.calculator.generate task.reward_fn=relax.rollout.calculator.reward

How it works in detail: docs/rollouts.md, "Inside `relax/rollout/calculator.py`".
"""

from __future__ import annotations

import operator
import re

from relax.rollout import SamplingParams
from relax.sample import Sample

MAX_TURNS = 3
CALL = re.compile(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*=?\s*")  # what the calculator evaluates
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculate(expression: str) -> str | None:
    """`12+34` -> `12+34=46`; None for anything that is not one such call."""
    m = CALL.fullmatch(expression)
    if not m:
        return None
    a, op, b = m.groups()
    return f"{a}{op}{b}={OPERATORS[op](int(a), int(b))}"


def tool_turn(tokenizer, content: str, chat_template: bool = True) -> list[int]:
    """The tokens of a user turn holding `content`, then the opening of the assistant's next
    turn: what the chat template adds to a conversation after an assistant turn. Without the
    template (task.apply_chat_template=false, a base model's prompts as they are), the result
    on a line of its own, as plain text continues."""
    if not chat_template:
        return tokenizer(f"\n{content}\n", add_special_tokens=False)["input_ids"]
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    head = tokenizer.apply_chat_template(before, tokenize=False)
    full = tokenizer.apply_chat_template(before + [{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(full[len(head):], add_special_tokens=False)["input_ids"]


async def generate(client, prompt, sampling_params: SamplingParams) -> Sample:
    tokenizer = client.tokenizer
    question = CALL.search(prompt.text)  # the prompt's own expression, for the scripted call
    response, loss_mask, log_probs, turns = [], [], [], []
    for turn in range(MAX_TURNS):
        gen = await client.generate(prompt.tokens + response, sampling_params)
        response += gen.tokens
        loss_mask += [1] * len(gen.tokens)
        log_probs += gen.log_probs
        text = tokenizer.decode(gen.tokens, skip_special_tokens=True)
        turns.append({"role": "assistant", "text": text})
        result = calculate(text) or (calculate(question.group(0)) if turn == 0 and question else None)
        if gen.status != "completed" or result is None or turn == MAX_TURNS - 1:
            break
        tool = tool_turn(tokenizer, result, prompt.chat_template)
        response += tool
        loss_mask += [0] * len(tool)
        log_probs += [0.0] * len(tool)
        turns.append({"role": "tool", "text": result})
    return Sample(index=prompt.index, group_index=prompt.group_index, prompt=prompt.text,
                  tokens=prompt.tokens + response, response_length=len(response), response=text,
                  label=prompt.label, loss_mask=loss_mask, rollout_log_probs=log_probs, status=gen.status,
                  metadata={**prompt.metadata, "turns": turns},
                  routed_experts=gen.routed_experts)  # (the last call fed the whole conversation)


def reward(sample: Sample) -> float:
    """The share of the model's answers (its turns that are not calculator calls) that are right."""
    answers = [t["text"] for t in sample.metadata["turns"]
               if t["role"] == "assistant" and not calculate(t["text"])]
    return sum(a.strip() == sample.label.strip() for a in answers) / max(len(answers), 1)
