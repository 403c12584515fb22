"""Defaults that `tpserve serve` shows in its --help and the modules that use them share, here in a module that
imports nothing, so the command's parser is built without importing torch (server/cli/main.py)."""

# --max-runtime-loras: adapters one API key may have loaded at runtime at once (server/engine/lora_registry.py)
MAX_RUNTIME_LORAS = 16
# --grammar-compile-workers: llguidance compiles in parallel (the GIL dropped); more would take the decode's cores
DEFAULT_COMPILE_WORKERS = 2
# --responses-store-key-share: of either bound of the stored responses, per API key (with several keys)
DEFAULT_STORE_KEY_SHARE = 0.25
# the output parsers' names (server/api/parsers/__init__.py maps them to their classes; a test checks they agree)
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "openai")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1", "gpt_oss")
