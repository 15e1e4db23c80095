// Small device vectors (hyperparameters, gradient control) whose layout is defined once, as
// a field list, here in C++: the enum indexes the vector in the kernels, and the same list's
// names are exported to Python (the nanobind module's contract()), which builds the vector by
// name. A field list is an X-macro: FIELDS(X) expands X(name) for each field, in order.
#pragma once

#define JF_VECTOR_INDEX(name) name,
#define JF_VECTOR_NAME(name) #name,

// Declares struct `Layout` with an enum of FIELDS' indices, kSize and kNames.
#define JF_DEFINE_VECTOR_LAYOUT(Layout, FIELDS)                                     \
  struct Layout {                                                                   \
    enum : int { FIELDS(JF_VECTOR_INDEX) kSize };                                   \
    static constexpr const char* kNames[kSize] = {FIELDS(JF_VECTOR_NAME)};          \
  }
