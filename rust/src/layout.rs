//! Pool geometry: byte size of a plane and the byte offset of (row, layer[, head]) inside it.
//!
//! Every constructor checks its arithmetic once (`checked_*`), so that the per-index offset math in
//! the hot path can run unchecked: any in-range (row, layer, head) has an offset below the plane's
//! byte size, which is known to fit in a `u64`.

use crate::error::{Error, Result};
use crate::request::Layout;

fn geometry_overflow(what: &str) -> Error {
    Error::geometry(format!(
        "host pool geometry overflows 64-bit byte offsets ({what})"
    ))
}

fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| geometry_overflow(what))
}

/// The geometry of one plane (one of K / V / latent / V4 page rows), validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneLayout {
    pub layout: Layout,
    /// `L`
    pub layers: u64,
    /// `S`
    pub rows: u64,
    /// `P`
    pub page_size: u64,
    /// `H`: segments per row (heads for `page_head`, head groups for `page_unified`; else 1).
    pub heads: u64,
    /// `I`: bytes of one row of one layer.
    pub item: u64,
    /// `I / H`: bytes of one contiguous segment (the whole item unless `page_head`).
    pub segment: u64,
    /// `L * I`
    pub layout_dim: u64,
    /// `C`: planes sharing one allocation, interleaved inside each layer (`page_unified` MHA: K
    /// and V, `C = 2`); 1 for every other layout.
    pub components: u64,
    /// This plane's place among them (`c < C`).
    pub component: u64,
    /// `C * L * S * I`: the bytes of the plane's allocation (shared by its `C` components).
    pub nbytes: u64,
}

impl PlaneLayout {
    pub fn new(
        layout: Layout,
        layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: usize,
        heads: usize,
    ) -> Result<Self> {
        Self::component_of(layout, layers, rows, page_size, item_bytes, heads, 0, 1)
    }

    /// Plane `p` of a pool's `n` planes: `page_unified` interleaves them as the components of
    /// one allocation, every other layout gives each plane its own (the one place that choice is
    /// made: the pool spec, the core and the planner all build their planes here).
    #[allow(clippy::too_many_arguments)]
    pub fn plane(
        layout: Layout,
        layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: usize,
        heads: usize,
        p: usize,
        n: usize,
    ) -> Result<Self> {
        let (component, components) = if layout == Layout::PageUnified {
            (p, n)
        } else {
            (0, 1)
        };
        Self::component_of(
            layout, layers, rows, page_size, item_bytes, heads, component, components,
        )
    }

    /// Plane `component` of `components` planes that share one allocation. Only `page_unified`
    /// interleaves planes (MHA's K and V inside each layer of each head group); every other
    /// layout gives each plane an allocation of its own, so `components` must be 1 there.
    #[allow(clippy::too_many_arguments)]
    pub fn component_of(
        layout: Layout,
        layers: usize,
        rows: usize,
        page_size: usize,
        item_bytes: usize,
        heads: usize,
        component: usize,
        components: usize,
    ) -> Result<Self> {
        let shared = layout == Layout::PageUnified;
        if components == 0 || component >= components || (!shared && components != 1) {
            return Err(Error::geometry(format!(
                "plane {component} of {components} sharing one allocation: only page_unified \
                 interleaves planes"
            )));
        }
        if page_size == 0 {
            return Err(Error::geometry("Page size must be positive"));
        }
        if heads == 0 {
            return Err(Error::geometry("head_num must be positive"));
        }
        let heads = if matches!(layout, Layout::PageHead | Layout::PageUnified) {
            heads
        } else {
            1
        };
        if item_bytes % heads != 0 {
            let (name, unit) = if layout == Layout::PageUnified {
                ("head_group_num", "head group")
            } else {
                ("head_num", "head")
            };
            return Err(Error::geometry(format!(
                "item size {item_bytes} bytes is not divisible by {name} {heads} ({} stores one \
                 segment of item_size / {name} bytes per {unit})",
                layout.name()
            )));
        }
        if matches!(
            layout,
            Layout::PageFirstDirect | Layout::PageHead | Layout::PageUnified
        ) && rows % page_size != 0
        {
            return Err(Error::geometry(format!(
                "{} needs whole pages: rows={rows} is not a multiple of page_size={page_size}",
                layout.name()
            )));
        }
        let (layers, rows, page_size, heads, item) = (
            layers as u64,
            rows as u64,
            page_size as u64,
            heads as u64,
            item_bytes as u64,
        );
        let components_u = components as u64;
        let layout_dim = mul(layers, item, "num_layers * item_bytes")?;
        let nbytes = mul(
            mul(layout_dim, rows, "num_layers * rows * item_bytes")?,
            components_u,
            "planes * num_layers * rows * item_bytes",
        )?;
        // A page block (page_first_direct / page_head / page_unified) spans C * P * L * I
        // bytes: at most the plane size when S >= P, but a pool smaller than one page must
        // still not overflow.
        mul(
            mul(layout_dim, page_size, "page_size * num_layers * item_bytes")?,
            components_u,
            "planes * page_size * num_layers * item_bytes",
        )?;
        Ok(Self {
            layout,
            layers,
            rows,
            page_size,
            heads,
            item,
            segment: item / heads,
            layout_dim,
            components: components_u,
            component: component as u64,
            nbytes,
        })
    }

    /// Byte offset of (row, layer, head) inside the plane. Callers keep `row < S`, `layer < L`,
    /// `head < H`; then the result is below `nbytes` and no step can overflow.
    #[inline(always)]
    pub fn offset_unchecked(&self, row: u64, layer: u64, head: u64) -> u64 {
        debug_assert!(row < self.rows && layer < self.layers && head < self.heads);
        match self.layout {
            Layout::LayerFirst => layer * self.rows * self.item + row * self.item,
            Layout::PageFirst => row * self.layout_dim + layer * self.item,
            Layout::PageFirstDirect => {
                let p = self.page_size;
                (row / p) * p * self.layout_dim + layer * p * self.item + (row % p) * self.item
            }
            Layout::PageHead => {
                let p = self.page_size;
                let seg = self.segment;
                (row / p) * p * self.layout_dim
                    + head * p * self.layers * seg
                    + (row % p) * self.layers * seg
                    + layer * seg
            }
            Layout::PageUnified => {
                let (p, c) = (self.page_size, self.components);
                (row / p) * c * p * self.layout_dim
                    + (((head * self.layers + layer) * c + self.component) * p + row % p)
                        * self.segment
            }
        }
    }

    /// Checked form of [`offset_unchecked`](Self::offset_unchecked) for callers outside the hot
    /// path (Python's `HostPool.offset`).
    pub fn offset(&self, row: u64, layer: u64, head: u64) -> Result<u64> {
        if row >= self.rows {
            return Err(Error::transfer(format!(
                "row {row} is out of range [0, {})",
                self.rows
            )));
        }
        if layer >= self.layers {
            return Err(Error::transfer(format!(
                "layer {layer} is out of range [0, {})",
                self.layers
            )));
        }
        if head >= self.heads {
            return Err(Error::transfer(format!(
                "head {head} is out of range [0, {})",
                self.heads
            )));
        }
        Ok(self.offset_unchecked(row, layer, head))
    }

    /// Bytes from one head's segment to the next head's segment of the same (row, layer):
    /// `P * L * (I / H)` for `page_head`, `L * C * P * (I / G)` for `page_unified` (head group
    /// `g` lives at `offset(row, layer, 0) + g * head_stride()`); the segment is the whole item
    /// (`H = 1`) in every other layout.
    #[inline(always)]
    pub fn head_stride(&self) -> u64 {
        self.page_size * self.layers * self.segment * self.components
    }

    /// Bytes from (row, layer, head) to (row, layer + 1, head): `S * I` for layer_first, `I` for
    /// page_first, `P * I` for page_first_direct and `I / H` for page_head.
    #[inline(always)]
    pub fn layer_stride(&self) -> u64 {
        match self.layout {
            Layout::LayerFirst => self.rows * self.item,
            Layout::PageFirst => self.item,
            Layout::PageFirstDirect => self.page_size * self.item,
            Layout::PageHead => self.segment,
            Layout::PageUnified => self.components * self.page_size * self.segment,
        }
    }

    /// Byte offset of the first row of host page `page` in layer `layer` for `page_first_direct`:
    /// a block of `P * I` contiguous bytes.
    #[inline(always)]
    pub fn page_block_offset(&self, page: u64, layer: u64) -> u64 {
        page * self.page_size * self.layout_dim + layer * self.page_size * self.item
    }
}

/// Bytes of one plane's allocation: `L * S * I` in every layout (no padding anywhere); for one
/// of `page_unified`'s interleaved planes, see [`PlaneLayout::component_of`].
pub fn plane_nbytes(
    layout: Layout,
    layers: usize,
    rows: usize,
    page_size: usize,
    item_bytes: usize,
    heads: usize,
) -> Result<u64> {
    Ok(PlaneLayout::new(layout, layers, rows, page_size, item_bytes, heads)?.nbytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pl(layout: Layout, l: usize, s: usize, p: usize, i: usize, h: usize) -> PlaneLayout {
        PlaneLayout::new(layout, l, s, p, i, h).unwrap()
    }

    /// Offsets straight from the contract's table (§2.1), written independently of the code.
    fn contract_offset(g: &PlaneLayout, t: u64, l: u64, h: u64) -> u64 {
        let (l_, s_, p, i_, h_) = (g.layers, g.rows, g.page_size, g.item, g.heads);
        let ld = l_ * i_;
        match g.layout {
            Layout::LayerFirst => l * s_ * i_ + t * i_,
            Layout::PageFirst => t * ld + l * i_,
            Layout::PageFirstDirect => (t / p) * p * ld + l * p * i_ + (t % p) * i_,
            Layout::PageHead => {
                (t / p) * p * ld + h * p * (ld / h_) + (t % p) * (ld / h_) + l * (i_ / h_)
            }
            // SGLang 0.5.23 PageUnifiedLayout: page_dims (page, group, layer, 2, P, hpg, D).
            Layout::PageUnified => {
                let (c_, c) = (g.components, g.component);
                let gb = i_ / h_;
                let layer_bytes = c_ * p * gb;
                let group_bytes_all = l_ * layer_bytes;
                (t / p) * h_ * group_bytes_all
                    + h * group_bytes_all
                    + l * layer_bytes
                    + c * p * gb
                    + (t % p) * gb
            }
        }
    }

    /// Every (row, layer, head) maps to a distinct segment and the segments tile the plane
    /// exactly; and each offset matches the contract formula.
    fn check_tiling(layout: Layout, l: usize, s: usize, p: usize, i: usize, h: usize) {
        let g = pl(layout, l, s, p, i, h);
        assert_eq!(g.nbytes, (l * s * i) as u64);
        let mut covered = vec![0u8; g.nbytes as usize];
        for t in 0..g.rows {
            for layer in 0..g.layers {
                for head in 0..g.heads {
                    let off = g.offset(t, layer, head).unwrap();
                    assert_eq!(
                        off,
                        contract_offset(&g, t, layer, head),
                        "{layout:?} t={t} l={layer} h={head}"
                    );
                    for b in 0..g.segment {
                        covered[(off + b) as usize] += 1;
                    }
                }
            }
        }
        assert!(
            covered.iter().all(|&c| c == 1),
            "{layout:?} does not tile the plane"
        );
    }

    /// `page_unified`'s `C` interleaved planes tile their one allocation exactly between them.
    fn check_unified_tiling(l: usize, s: usize, p: usize, i: usize, groups: usize, c: usize) {
        let planes: Vec<PlaneLayout> = (0..c)
            .map(|k| PlaneLayout::component_of(Layout::PageUnified, l, s, p, i, groups, k, c))
            .collect::<Result<_>>()
            .unwrap();
        let nbytes = planes[0].nbytes;
        assert_eq!(nbytes, (c * l * s * i) as u64);
        let mut covered = vec![0u8; nbytes as usize];
        for g in &planes {
            assert_eq!(g.nbytes, nbytes);
            for t in 0..g.rows {
                for layer in 0..g.layers {
                    for head in 0..g.heads {
                        let off = g.offset(t, layer, head).unwrap();
                        assert_eq!(off, contract_offset(g, t, layer, head));
                        assert_eq!(off, g.offset(t, layer, 0).unwrap() + head * g.head_stride());
                        for b in 0..g.segment {
                            covered[(off + b) as usize] += 1;
                        }
                    }
                }
            }
        }
        assert!(
            covered.iter().all(|&n| n == 1),
            "page_unified does not tile"
        );
    }

    #[test]
    fn page_unified_tiles_its_allocation_and_matches_sglangs_strides() {
        for &(l, s, p, i, g, c) in &[
            (6, 12, 4, 64, 2, 2),
            (3, 8, 8, 16, 1, 1),
            (5, 6, 3, 48, 3, 2),
            (1, 2, 2, 32, 4, 2),
        ] {
            check_unified_tiling(l, s, p, i, g, c);
        }
        // SGLang's example: P=4, L=6, H=4, G=2, D=8, itemsize 2: group rows of 32 bytes, layer
        // cells of 256, head groups of 1536, pages of 3072. V (component 1) of token 4 (page 1,
        // slot 0), layer 1, group 1.
        let v = PlaneLayout::component_of(Layout::PageUnified, 6, 12, 4, 64, 2, 1, 2).unwrap();
        assert_eq!(v.offset(4, 1, 1).unwrap(), 3072 + 1536 + 256 + 4 * 32);
        assert_eq!(v.head_stride(), 1536);
        assert_eq!(v.layer_stride(), 256);
        // Planes share an allocation only in page_unified.
        assert!(PlaneLayout::component_of(Layout::PageFirst, 1, 4, 4, 8, 1, 1, 2).is_err());
        assert!(PlaneLayout::component_of(Layout::PageUnified, 1, 4, 4, 8, 1, 2, 2).is_err());
        assert!(PlaneLayout::new(Layout::PageUnified, 1, 6, 4, 8, 1).is_err()); // not whole pages
    }

    #[test]
    fn layouts_tile_planes_with_odd_sizes() {
        for &(l, s, p, i) in &[
            (7, 12, 4, 12),
            (61, 3, 1, 3),
            (3, 8, 8, 1),
            (2, 6, 3, 656),
            (5, 4, 2, 1152),
        ] {
            check_tiling(Layout::LayerFirst, l, s, p, i, 1);
            check_tiling(Layout::PageFirst, l, s, p, i, 1);
            check_tiling(Layout::PageFirstDirect, l, s, p, i, 1);
        }
        for &(l, s, p, i, h) in &[
            (7, 12, 4, 12, 3),
            (3, 8, 8, 16, 4),
            (61, 2, 1, 6, 2),
            (2, 6, 3, 656, 8),
        ] {
            check_tiling(Layout::PageHead, l, s, p, i, h);
        }
    }

    #[test]
    fn head_and_layer_strides_step_between_segments() {
        for layout in [
            Layout::LayerFirst,
            Layout::PageFirst,
            Layout::PageFirstDirect,
            Layout::PageHead,
        ] {
            let g = pl(layout, 7, 12, 4, 12, 3);
            for (t, l) in [(0, 0), (5, 3), (11, 6)] {
                for h in 0..g.heads {
                    let at = g.offset(t, l, h).unwrap();
                    assert_eq!(at, g.offset(t, l, 0).unwrap() + h * g.head_stride());
                    assert_eq!(
                        at,
                        g.offset(t, 0, h).unwrap() + l * g.layer_stride(),
                        "{layout:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn page_head_with_one_head_is_token_major_within_a_page() {
        let g = pl(Layout::PageHead, 5, 8, 4, 12, 1);
        assert_eq!(g.offset(5, 3, 0).unwrap(), 4 * 5 * 12 + 12 * 5 + 3 * 12);
    }

    #[test]
    fn heads_ignored_outside_page_head() {
        let g = pl(Layout::PageFirst, 2, 4, 2, 12, 5);
        assert_eq!((g.heads, g.segment), (1, 12));
        assert!(g.offset(0, 0, 1).is_err());
    }

    #[test]
    fn asymmetric_planes_differ_only_in_item() {
        let k = pl(Layout::PageFirstDirect, 3, 8, 4, 256, 1);
        let v = pl(Layout::PageFirstDirect, 3, 8, 4, 192, 1);
        assert_eq!(
            k.offset(6, 2, 0).unwrap(),
            4 * 3 * 256 + 2 * 4 * 256 + 2 * 256
        );
        assert_eq!(
            v.offset(6, 2, 0).unwrap(),
            4 * 3 * 192 + 2 * 4 * 192 + 2 * 192
        );
    }

    #[test]
    fn v4_rows_page_size_one() {
        // V4: S = host pages, P = 1, item = item_bytes; page_first_direct == page_first.
        let a = pl(Layout::PageFirstDirect, 61, 10, 1, 584, 1);
        let b = pl(Layout::PageFirst, 61, 10, 1, 584, 1);
        for t in 0..10 {
            for l in [0, 30, 60] {
                assert_eq!(a.offset(t, l, 0).unwrap(), b.offset(t, l, 0).unwrap());
            }
        }
        assert_eq!(a.page_block_offset(7, 60), 7 * 61 * 584 + 60 * 584);
    }

    #[test]
    fn page_block_is_first_row_of_page() {
        let g = pl(Layout::PageFirstDirect, 7, 12, 4, 12, 1);
        for page in 0..3 {
            for l in 0..7 {
                assert_eq!(
                    g.page_block_offset(page, l),
                    g.offset(page * 4, l, 0).unwrap()
                );
            }
        }
    }

    #[test]
    fn rejects_bad_geometry() {
        let e = PlaneLayout::new(Layout::PageHead, 2, 8, 4, 12, 5).unwrap_err();
        assert!(e.to_string().contains("not divisible by head_num 5"), "{e}");
        let e = PlaneLayout::new(Layout::PageFirstDirect, 2, 10, 4, 16, 1).unwrap_err();
        assert!(
            e.to_string().contains("not a multiple of page_size=4"),
            "{e}"
        );
        assert!(PlaneLayout::new(Layout::LayerFirst, 2, 10, 0, 16, 1).is_err());
        assert!(PlaneLayout::new(Layout::PageHead, 2, 8, 4, 16, 0).is_err());
        // layer_first / page_first do not need whole pages.
        assert!(PlaneLayout::new(Layout::LayerFirst, 2, 10, 4, 16, 1).is_ok());
    }

    #[test]
    fn overflow_is_an_error() {
        let e = PlaneLayout::new(Layout::LayerFirst, 1 << 20, 1 << 30, 1, 1 << 20, 1).unwrap_err();
        assert!(
            matches!(e, Error::Layout(crate::error::LayoutError::Geometry(_))),
            "{e:?}"
        );
        assert!(e.to_string().contains("overflows"));
        assert!(plane_nbytes(Layout::PageFirst, usize::MAX, 2, 1, 2, 1).is_err());
        // Big page with a tiny pool.
        assert!(PlaneLayout::new(Layout::LayerFirst, 1 << 30, 0, 1 << 40, 1 << 10, 1).is_err());
    }

    #[test]
    fn zero_sized_planes() {
        assert_eq!(plane_nbytes(Layout::PageFirst, 4, 0, 1, 16, 1).unwrap(), 0);
        assert_eq!(plane_nbytes(Layout::LayerFirst, 0, 8, 1, 16, 1).unwrap(), 0);
    }

    #[test]
    fn offset_checks_ranges() {
        let g = pl(Layout::LayerFirst, 3, 4, 1, 8, 1);
        assert!(g.offset(4, 0, 0).is_err());
        assert!(g.offset(0, 3, 0).is_err());
        assert_eq!(g.offset(3, 2, 0).unwrap(), 2 * 4 * 8 + 3 * 8);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        const LAYOUTS: [Layout; 4] = [
            Layout::LayerFirst,
            Layout::PageFirst,
            Layout::PageFirstDirect,
            Layout::PageHead,
        ];

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 2000,
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

            /// Small geometries (page sizes that are not powers of two, any head count that
            /// divides the item): every (row, layer, head) segment is where the contract puts it,
            /// and the segments tile `[0, nbytes)` exactly, with no gap and no overlap.
            #[test]
            fn offsets_tile_every_plane_exactly(
                layout in prop::sample::select(LAYOUTS.to_vec()),
                l in 1usize..=7,
                pages in 0usize..=4,
                p in 1usize..=9,
                seg in 1usize..=5,
                h in 1usize..=4,
            ) {
                let heads = if layout == Layout::PageHead { h } else { 1 };
                check_tiling(layout, l, pages * p, p, seg * heads, heads);
            }

            /// Any sizes at all, up to `usize::MAX`: `new` returns an error or a geometry whose
            /// byte count is exact (checked in 128-bit arithmetic) and whose last segment ends
            /// inside the plane. It never panics or wraps.
            #[test]
            fn adversarial_geometry_is_refused_or_exact(
                layout in prop::sample::select(LAYOUTS.to_vec()),
                l in prop_oneof![Just(0usize), 1usize..64, any::<usize>()],
                s in prop_oneof![Just(0usize), 1usize..1024, any::<usize>()],
                p in prop_oneof![Just(0usize), 1usize..64, any::<usize>(), Just(usize::MAX)],
                i in prop_oneof![Just(0usize), 1usize..4096, any::<usize>()],
                h in prop_oneof![Just(0usize), 1usize..16, any::<usize>()],
            ) {
                let Ok(g) = PlaneLayout::new(layout, l, s, p, i, h) else {
                    return Ok(());
                };
                let exact = l as u128 * s as u128 * i as u128;
                prop_assert_eq!(g.nbytes as u128, exact);
                prop_assert!(p > 0 && h > 0);
                if g.rows > 0 && g.layers > 0 && g.item > 0 {
                    let last = g.offset(g.rows - 1, g.layers - 1, g.heads - 1).unwrap();
                    prop_assert!(last as u128 + g.segment as u128 <= exact);
                    // One past each end is refused, not wrapped.
                    prop_assert!(g.offset(g.rows, 0, 0).is_err());
                    prop_assert!(g.offset(0, g.layers, 0).is_err());
                    prop_assert!(g.offset(0, 0, g.heads).is_err());
                }
            }
        }
    }
}
