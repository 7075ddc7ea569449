"""Built-in text, special tokens and chat template of the tokenizer synthetic checkpoints ship.

The corpus is small on purpose: a byte-level BPE trained on it is deterministic, takes well
under a second, and still yields a few hundred merges of real English words and Python
syntax, so tokenized prompts look like ordinary text to the code under test.
"""
from __future__ import annotations

# Special tokens at their offsets after the base vocabulary, as the Kimi family numbers them
# (K2 / Kimi Linear / K3: [BOS] is the first id after the 163,584 base tokens). The ids between
# them are reserved tokens; [UNK] and [PAD] take the last two ids of the special block.
SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
}
UNK_TOKEN, PAD_TOKEN = "[UNK]", "[PAD]"  # at block size - 2 and - 1
BOS_TOKEN, EOS_TOKEN, IM_END, MEDIA_PAD = "[BOS]", "[EOS]", "<|im_end|>", "<|media_pad|>"

# Renders [{"role": ..., "content": ...}] in the Kimi turn format
# <|im_user|>user<|im_middle|>content<|im_end|> (system: <|im_system|>, assistant: <|im_assistant|>,
# any other role as a system-style turn under its own name). `content` may also be a list of
# OpenAI-style parts ({"type": "text", "text": ...}); only the text parts are kept. With
# add_generation_prompt the result ends with the opening of an assistant turn.
#
# The agent parts, laid out as Kimi K2 lays them out (plain conversations render as before):
# - `tools` (OpenAI function tools) first, as one system-style turn named tool_declare holding their JSON;
# - an assistant message's `tool_calls` after its text, in the tool-call section the model writes:
#   <|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>...
#   <|tool_calls_section_end|>, ID the call's id (functions.NAME:IDX when it has none, IDX counting the
#   conversation's calls from 0), ARGS the arguments as given (a mapping as JSON);
# - a tool message as a system-style turn named tool whose text starts "## Return of ID\n";
# - an assistant message's `reasoning_content` as <think>...</think> before its text, for the messages
#   after the last answer that called no tool (the reasoning of finished turns is not shown again).
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(answered=-1, calls=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}"
    "{%- set ns.answered = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- elif message['content'] is none -%}"
    "{%- set text = '' -%}"
    "{%- else -%}"
    "{%- set text = namespace(value='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set text = text.value -%}"
    "{%- endif -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'user' -%}{{- '<|im_user|>' -}}"
    "{%- elif role == 'assistant' -%}{{- '<|im_assistant|>' -}}"
    "{%- else -%}{{- '<|im_system|>' -}}{%- endif -%}"
    "{{- role + '<|im_middle|>' -}}"
    "{%- if role == 'assistant' and message.get('reasoning_content') and loop.index0 > ns.answered -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{%- if role == 'tool' and message.get('tool_call_id') -%}"
    "{{- '## Return of ' + message['tool_call_id'] + '\\n' -}}"
    "{%- endif -%}"
    "{{- text -}}"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|tool_calls_section_begin|>' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] -%}"
    "{%- set id = call.get('id') or 'functions.' + fn['name'] + ':' + (ns.calls | string) -%}"
    "{%- set ns.calls = ns.calls + 1 -%}"
    "{%- set args = fn.get('arguments') -%}"
    "{{- '<|tool_call_begin|>' + id + '<|tool_call_argument_begin|>' -}}"
    "{{- args if args is string else (args | tojson) -}}"
    "{{- '<|tool_call_end|>' -}}"
    "{%- endfor -%}"
    "{{- '<|tool_calls_section_end|>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)

CORPUS = '''\
The river ran slowly past the old mill, and the morning light came through the trees in long
yellow lines. Nobody in the village could remember when the wheel had last turned. Children
still climbed the stone wall to look at the water, and their parents still told them to be
careful, the way parents always have.

A good explanation starts with what the reader already knows. It names the problem, shows a
small example, and only then gives the general rule. When the rule has exceptions, it says so
plainly instead of hiding them in a footnote. Short sentences help; so do concrete numbers.

Memory is faster than disk, and disk is larger than memory. Every system that stores more
data than it can hold at once has to decide what to keep close and what to fetch when it is
needed. The cost of a wrong guess is a wait. The cost of a right guess is the space it uses.

She opened the window, listened to the rain for a while, and then went back to the letter.
"Dear Thomas," it began, "the weather here has been terrible, but the work is going well.
We finished the second bridge on Tuesday, two weeks ahead of the plan."

Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many days are there in a week?
Answer: There are seven days in a week.
Question: Why is the sky blue?
Answer: Sunlight is scattered by the air, and blue light is scattered more than red light.

A language model reads a sequence of tokens and predicts the next one. It does this again and
again, each time adding the new token to the sequence. The model itself never sees letters or
words, only numbers; the tokenizer turns text into those numbers and back again.

def read_config(path):
    """Load a JSON config file and return it as a dictionary."""
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

    def __repr__(self):
        return f"Counter(value={self.value})"


def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def mean(values):
    if not values:
        raise ValueError("mean() of an empty list")
    return sum(values) / len(values)


for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

import os
import sys
from pathlib import Path

def list_files(root):
    return sorted(p.name for p in Path(root).iterdir() if p.is_file())

result = {"name": "example", "size": 1024, "items": [1, 2, 3], "ok": True}
numbers = [x * x for x in range(20) if x > 3]
total = sum(numbers)
print("total:", total)

The committee met on Thursday afternoon. After a long discussion about the budget, they agreed
to delay the new building until the spring and to spend the money on repairs instead. Some
members were unhappy, but everyone accepted that the roof could not wait another winter.

Hello! How are you today? I am fine, thank you. What would you like to talk about? We could
talk about books, music, travel, science, or anything else you find interesting.
'''
