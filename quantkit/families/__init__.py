"""What quantkit knows about model families, as tables: the families tested end to end, the module classes whose
behaviour scale folding relies on, MoE routers, and what engines refuse per family. Code that needs a family fact
reads it here; nothing under algorithms/ names a model class.
"""

# tested end to end (tests/test_families.py); other architectures whose blocks hold nn.Linear layers also quantize
SUPPORTED_FAMILIES = ("Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3, Granite, OLMo 2, OPT; MoE: Qwen3-MoE, "
                      "Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3")

ROUTERS = ("gate", "router", "shared_expert_gate")  # MoE routing Linears: left in float, as every peer does

# Norms computing weight * normalize(x) (+ bias): dividing weight and bias by s divides the output by s.
LINEAR_NORMS = {"LayerNorm", "RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                 "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm", "DeepseekV3RMSNorm",
                 "GraniteRMSNorm", "Phi3RMSNorm", "Olmo2RMSNorm"}
# Gemma's RMSNorm computes (1 + weight) * normalize(x): the scale is folded into (1 + weight), not into weight.
OFFSET_NORMS = {"Gemma2RMSNorm", "Gemma3RMSNorm", "GemmaRMSNorm"}
KNOWN_BLOCKS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
          "Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer", "MixtralDecoderLayer", "OlmoeDecoderLayer",
          "DeepseekV3DecoderLayer", "GraniteDecoderLayer", "Phi3DecoderLayer", "Gemma2DecoderLayer",
          "Gemma3DecoderLayer", "Olmo2DecoderLayer"}
# norms inside self_attn that act on queries and keys only (Qwen3, OLMoE, OLMo 2, Gemma 3), so v -> o stays exact;
# DeepSeek's MLA norms sit on the low-rank q / kv paths, each with its own mapping
QK_NORMS = {"q_norm", "k_norm", "q_a_layernorm", "kv_a_layernorm"}

# vLLM 0.32 `_FLOAT16_NOT_SUPPORTED_MODELS` (vllm/config/model.py): "Numerical instability"
VLLM_NO_FLOAT16 = {"gemma2", "gemma3", "gemma3_text", "glm4"}
