// What GCC 12's headers and libstdc++.a take from glibc newer than 2.28, for the manylinux_2_28
// wheels (CMakeLists.txt, JAXFUSE_GLIBC_STUBS): defined here, hidden in each module, so that
// nothing binds to a symbol glibc 2.28 lacks. A source build does not compile this file.
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

#define JAXFUSE_HIDDEN __attribute__((visibility("hidden")))

extern "C" {

// GLIBC_2.32: libstdc++'s headers skip atomic reference counts when it says the process is
// single-threaded. 0 says "maybe not", which is always correct.
JAXFUSE_HIDDEN char __libc_single_threaded = 0;

// GLIBC_2.33 made fstat64 a libc symbol; before, it was a wrapper around __fxstat64 (2.2.5).
// libstdc++.a's file buffers call it.
struct stat64;
int __fxstat64(int version, int fd, struct stat64* buf);
JAXFUSE_HIDDEN int fstat64(int fd, struct stat64* buf) {
  return __fxstat64(1 /* _STAT_VER_LINUX */, fd, buf);
}

// GLIBC_2.36: libstdc++.a's std::random_device reads it; the getrandom system call (Linux 3.17)
// gives the same bytes.
JAXFUSE_HIDDEN uint32_t arc4random(void) {
  uint32_t value = 0;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(&value);
  size_t got = 0;
  while (got < sizeof value) {
    const long n = syscall(SYS_getrandom, bytes + got, sizeof value - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      break;
    }
  }
  return value;
}

}  // extern "C"
