"""The quantization_config we write is compressed-tensors' own QuantizationConfig, and reads back as we wrote it."""
import json

from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

from llmopt.stages.compressed import LinearScheme, build_quantization_config, parse_schemes

LINEARS = ["model.layers.0.q_proj", "model.layers.0.k_proj", "model.layers.1.q_proj", "lm_head"]
SCHEMES = {"model.layers.0.q_proj": LinearScheme(4, 128, True, False), "model.layers.1.q_proj": LinearScheme(4, 128, True, False),
           "model.layers.0.k_proj": LinearScheme(8, -1, False, True)}
EMBEDDINGS = {"model.embed_tokens": LinearScheme(8, -1, True, False)}


def test_the_config_is_the_library_s_dump():
    written = build_quantization_config(SCHEMES, LINEARS, EMBEDDINGS)
    json.dumps(written)  # plain JSON types only
    library = QuantizationConfig.model_validate(written)
    assert library.quantization_status == QuantizationStatus.COMPRESSED and library.format == "mixed-precision"
    assert written == {**library.model_dump(mode="json"), "sparsity_config": {}, "transform_config": {}}


def test_the_config_reads_back_as_written():
    written = build_quantization_config(SCHEMES, LINEARS, EMBEDDINGS)
    assert parse_schemes(written, LINEARS, list(EMBEDDINGS)) == {**SCHEMES, **EMBEDDINGS}
    assert written["ignore"] == ["lm_head"]
