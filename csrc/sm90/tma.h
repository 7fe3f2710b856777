// Host side of the TMA tile loads: a [B, T, H, D] tensor (16-bit elements, element strides, unit
// stride along D) described as a 4-D tensor map with a box of 64 (D) x 1 (H) x 64 (T) x 1 (B)
// and the 128-byte swizzle that wgmma reads.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/host_device.h"
#include "flashgdn/flashgdn.h"

namespace flashgdn::sm90 {

// Where the H, T and B coordinates go among the map's dimensions 1..3 (dimension 0 is D). The
// map orders the outer dimensions by stride so that each contains the previous (what TMA asks
// for), which lets head-first storage ([B, H, T, D] memory viewed as [B, T, H, D]) load too.
struct TileMapOrder {
  int8_t h = 1, t = 2, b = 3;
  // The coordinate of map dimension k (1..3) for head h, token t, batch row b.
  FGDN_HOST_DEVICE int32_t at(int k, int32_t h_, int32_t t_, int32_t b_) const {
    return h == k ? h_ : (t == k ? t_ : b_);
  }
};

struct TileMap {
  CUtensorMap map;
  TileMapOrder order;
};

// True if TMA can address the tensor as it is: 16-byte aligned data, positive strides that are
// multiples of 16 bytes below 2^40 for every extent above 1, outer dimensions that nest, extents
// within 2^31. Otherwise the forward copies it into its workspace first (tile_map_packed_bytes).
bool tile_map_direct(const fgdn_tensor& t);
// Bytes of a packed contiguous copy [B, T, H, D] (what a non-direct tensor needs).
size_t tile_map_packed_bytes(const fgdn_tensor& t);

// Encodes the map for t (direct), or for its packed copy at `packed` (contiguous [B, T, H, D]).
TileMap make_tile_map(const fgdn_tensor& t, void* packed = nullptr);

}  // namespace flashgdn::sm90
