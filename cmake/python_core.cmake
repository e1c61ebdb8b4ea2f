# The Python package's extension mha._core: python/src/mha_core.c over
# libmha's static library (target mha_static), from whichever project
# includes this file: the package's own build (python/CMakeLists.txt,
# driven by pip) and, with -DMHA_BUILD_PYTHON=ON, the top-level build, so
# that one instrumented libmha serves the C and the Python tests (the
# matrix's ASan stage).  Needs find_package(Python ... Development.Module).
Python_add_library(_core MODULE WITH_SOABI
                   ${CMAKE_CURRENT_LIST_DIR}/../python/src/mha_core.c)
target_link_libraries(_core PRIVATE mha_static)
target_compile_options(_core PRIVATE -Wall -Wextra)
set_target_properties(_core PROPERTIES C_VISIBILITY_PRESET hidden)
# Debian's OpenMP build of OpenBLAS is linked by path (see the top-level
# CMakeLists.txt): the extension finds it through its RPATH.
if(MHA_OPENBLAS_OMP_LIB)
  get_filename_component(mha_omp_dir "${MHA_OPENBLAS_OMP_LIB}" DIRECTORY)
  set_target_properties(_core PROPERTIES INSTALL_RPATH "${mha_omp_dir}"
                                         BUILD_RPATH "${mha_omp_dir}")
endif()
