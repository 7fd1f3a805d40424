"""GLM-format chat templates (GLM-4.5, GLM-4.7, GLM-5) and a tiny GLM-5-shaped model directory that carries one.

The templates are written here, in our own words, to the layout GLM's published templates produce (zai-org's
GLM-4.5 / GLM-4.7 chat_template.jinja, as recalled for the format only). GLM-5's is taken to be GLM-4.7's layout,
which is how GLM-5 is served elsewhere (the glm47 tool parser); GLM-5's own template file is not in this repo and
was not compared:

    [gMASK]<sop>[<|system|>(tools block)]<|system|>S<|user|>U<|assistant|><think>R</think>C<tool_call>f
    <arg_key>k</arg_key><arg_value>v</arg_value></tool_call><|observation|><tool_response>T</tool_response>
    <|assistant|><think>

GLM-4.5 puts a newline after each role token and between the call tags and does not open <think> in the generation
prompt; GLM-4.7 and GLM-5 do neither newline and open <think> (`</think>` with enable_thinking false). Like GLM's own
templates these iterate `arguments.items()` and print tool content as it comes, so an assistant call whose arguments
are a JSON string, or tool content that is a list of parts, fails or renders wrong unless the server normalises the
messages first (field case C60). Assistant reasoning is kept only after the last user message (the tool loop)."""
from __future__ import annotations

import pathlib

_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>{NL}# Tools

Call functions with the format below; their signatures are listed in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}</tools>
<tool_call>{function-name}{NL}<arg_key>{key}</arg_key>{NL}<arg_value>{value}</arg_value>{NL}</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'developer' -%}<|system|>{NL}{{ m.content }}
{%- elif m.role == 'user' -%}<|user|>{NL}{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>{NL}
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>
{%- else -%}{THINK_OFF}{%- endif -%}
{%- if m.content %}{NL}{{ m.content }}{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{NL}<tool_call>{{ f.name }}
{%- for k, v in f.arguments.items() -%}
{NL}<arg_key>{{ k }}</arg_key>{NL}<arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}{NL}</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
{NL}<tool_response>{NL}{{ m.content }}{NL}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{GEN_THINK}{%- endif -%}"""


def _glm_template(nl: str, think_off: str, gen_think: str) -> str:
    return (_TEMPLATE.replace("{NL}", nl).replace("{THINK_OFF}", think_off)
            .replace("{GEN_THINK}", gen_think))


# A newline is an expression: the templates' whitespace control would strip a literal one.
NEWLINE = "{{ '\\n' }}"
GLM45_TEMPLATE = _glm_template(
    NEWLINE, NEWLINE + "<think></think>",
    "{{ '\\n<think></think>' if enable_thinking is defined and not enable_thinking else '' }}")
GLM47_TEMPLATE = _glm_template(
    "", "</think>", "{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}")
GLM5_TEMPLATE = GLM47_TEMPLATE
TEMPLATES = {"glm45": GLM45_TEMPLATE, "glm47": GLM47_TEMPLATE, "glm5": GLM5_TEMPLATE}

# GLM's role tokens are special (eos: endoftext, user, observation, as GLM's generation_config); the think and call
# tags are plain added tokens, as in GLM's tokenizer, so they survive skip_special_tokens.
ROLE_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>", "<tool_response>", "</tool_response>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]


def glm_tokenizer(base_hf, template: str):
    """A copy of transformers tokenizer `base_hf` with GLM's tokens added, eos <|endoftext|>, and `template`."""
    import copy
    hf = copy.deepcopy(base_hf)
    hf.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    hf.add_tokens(TAG_TOKENS)
    hf.eos_token = "<|endoftext|>"
    hf.chat_template = template
    return hf


def glm5_model_dir(base_hf, target: pathlib.Path) -> pathlib.Path:
    """A tiny random-weight glm_moe_dsa (tests/model/test_families.py's config: 16 indexer heads, index_topk 8, so
    prompts past 8 tokens attend sparsely) with a GLM-5-format tokenizer; eos as GLM's generation_config."""
    from tests.model.test_families import FAMILIES, build_family

    hf = glm_tokenizer(base_hf, GLM5_TEMPLATE)
    config_cls, model_cls, extra = FAMILIES["glm_moe_dsa"]
    eos = [hf.convert_tokens_to_ids(t) for t in EOS_TOKENS]
    spec = (config_cls, model_cls, {**extra, "vocab_size": len(hf), "bos_token_id": None, "pad_token_id": eos[0],
                                    "eos_token_id": eos})
    build_family(target, "glm_moe_dsa", seed=5, spec=spec)
    hf.save_pretrained(target)
    return target
