from jaxfuse._ffi import backends
