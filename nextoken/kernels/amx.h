/* What every AMX loop needs (qmatmul_amx.c, decode.c's LoRA): the kernel's leave to use the tile
 * data, and the tile configuration's layout. Linux only (arch_prctl). */
#ifndef NEXTOKEN_AMX_H
#define NEXTOKEN_AMX_H
#include <stdint.h>
#include <sys/syscall.h>
#include <immintrin.h>
long syscall(long number, ...); /* unistd.h declares it only for _DEFAULT_SOURCE builds */

/* AMX needs the kernel's leave to use its tile data (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM,
 * once per process); 1 when granted. A kernel or hypervisor that refuses leaves the AVX-512 loops. */
static int amx_ready(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

/* The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 8 tiles.
 * Write it through a volatile object: GCC may drop stores to a local that only ldtilecfg reads. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tilecfg_t;
#endif
