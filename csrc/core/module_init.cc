// The init of the production modules: what module.h says, nothing more.
#include "core/module.h"

NB_MODULE(JAXFUSE_MODULE_NAME, m) { jaxfuse::define_module(m); }
