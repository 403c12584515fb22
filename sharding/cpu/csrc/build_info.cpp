// What a build of these kernels was compiled for (the variant's name, set by sharding/cpu/variants.py). A build is
// checked for this symbol without being loaded when the build host cannot run it, and read back after a load.
#ifndef TPSERVE_BUILD
#define TPSERVE_BUILD "unnamed"
#endif

extern "C" const char* tpserve_kernels_build() { return TPSERVE_BUILD; }
