// paged_decode_attn_pdl.cu: the tiled decode attention (paged_decode_attn_tiled.cu, the same entry points and
// bits) built for sm_90 with programmatic dependent launch: TileStep's overlapped tiles (TiledAttention
// overlap_tiles=True) launch the step's later tiles with the programmatic-serialization attribute, so a tile's K/V
// streaming overlaps the end of the tile before it (see ATT_PDL in that file).
#define ATT_PDL 1
#include "paged_decode_attn_tiled.cu"
