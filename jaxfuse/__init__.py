from jaxfuse._ffi import backends
from jaxfuse.decoder import DecoderConfig, DecoderWeights, KVCache, persistent_decoder, decoder_reference
