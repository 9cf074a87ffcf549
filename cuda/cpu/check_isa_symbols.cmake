# Fails the build if an instruction-set variant of the CPU kernels exports a linker-mergeable
# (weak or global) symbol outside its own namespace: the linker could then hand code compiled
# for AVX-512 to a caller running on a CPU without it. Run as: cmake -DNM=... -DOBJECT=...
# -DISA=... -P check_isa_symbols.cmake
execute_process(COMMAND "${NM}" -C --defined-only "${OBJECT}" OUTPUT_VARIABLE symbols
                COMMAND_ERROR_IS_FATAL ANY)
string(REPLACE "\n" ";" lines "${symbols}")
foreach(line IN LISTS lines)
  if(line MATCHES "^[0-9a-f]+ [WVTDBRuvw] (.*)$")
    set(name "${CMAKE_MATCH_1}")
    if(NOT name MATCHES "^(void |bool |float |long |int |auto )?jax_flash::cpu::${ISA}::")
      message(FATAL_ERROR "${OBJECT}: symbol outside jax_flash::cpu::${ISA}: ${name}")
    endif()
  endif()
endforeach()
