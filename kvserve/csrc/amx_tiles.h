/* AMX tile configuration shared by the AMX kernels (amx_gemm.c, prefill_attention.c): include
   it inside an __AMX_TILE__ guard, after immintrin.h. config_tiles() loads palette 1 with all
   eight tiles 16 rows x 64 bytes, the only shape they use (Intel Architecture Instruction Set
   Extensions Programming Reference, ch. 3). */
#ifndef KV_AMX_TILES_H
#define KV_AMX_TILES_H

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static void config_tiles(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif /* KV_AMX_TILES_H */
