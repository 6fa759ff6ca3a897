//! The support table: for every (pool kind, layout, io backend, transfer) the copy hostkv_rs
//! moves bytes with, or SGLang's refusal text for it. Construction, every transfer check, the
//! planner's strategy, the CLI's and the benchmark's matrix, and the layouts install() hands back
//! to SGLang's own classes all read this one module.
//!
//! Adding a layout is rows here (and its byte order in `crate::layout`); a refusal text changes
//! only in [`refusal`].

use crate::error::{Error, Result};
use crate::plan::Strategy;
use crate::pool::PoolKind;
use crate::request::{Backend, Layout};

/// What a transfer moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// Slots or whole pages between the device pool and this host pool (every kind).
    Slots,
    /// DeepSeek V4's token-granular path (SGLang's `transfer_cache_dsv4_mla`): per token, its
    /// value and scale segments of a C4 page row.
    Tokens,
    /// A layer-sharded MLA backup: each rank copies the layers it owns, one layer at a time.
    ShardedBackup,
}

impl Transfer {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "slots" => Ok(Self::Slots),
            "tokens" => Ok(Self::Tokens),
            "sharded_backup" => Ok(Self::ShardedBackup),
            other => Err(Error::value(format!(
                "unknown transfer kind {other:?}; expected slots, tokens or sharded_backup"
            ))),
        }
    }
}

/// The io_backend an SGLang caller named (`None` for a value that is not a string).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Io {
    Kernel,
    Direct,
    /// Ascend's kernels: served only where SGLang moves the same bytes the direct way on a host
    /// without an NPU (V4 paged pools).
    KernelAscend,
    Other,
}

impl Io {
    fn of(name: Option<&str>) -> Self {
        match name {
            Some("kernel") => Self::Kernel,
            Some("direct") => Self::Direct,
            Some("kernel_ascend") => Self::KernelAscend,
            _ => Self::Other,
        }
    }
}

/// How a served cell moves bytes: the engine backend and the planner's strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub backend: Backend,
    pub strategy: Strategy,
}

/// What construction does with a layout a caller names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// hostkv_rs allocates and serves it.
    Ours,
    /// SGLang's own class of this kind serves it and hostkv_rs does not: install() hands the
    /// pool back to SGLang (Ascend's `page_first_kv_split` for MLA).
    HandBack,
}

use Layout::*;
use PoolKind::*;
use Strategy::*;
use Transfer::*;

/// The layouts each kind builds.
#[rustfmt::skip]
const BUILDS: &[(PoolKind, &str, Build)] = &[
    (Mha, "layer_first", Build::Ours),
    (Mha, "page_first", Build::Ours),
    (Mha, "page_first_direct", Build::Ours),
    (Mha, "page_head", Build::Ours),
    (Mha, "page_unified", Build::Ours),
    (AsymmetricMha, "page_first", Build::Ours),
    (AsymmetricMha, "page_first_direct", Build::Ours),
    (Mla, "layer_first", Build::Ours),
    (Mla, "page_first", Build::Ours),
    (Mla, "page_first_direct", Build::Ours),
    (Mla, "page_unified", Build::Ours),
    (Mla, "page_first_kv_split", Build::HandBack),
    (V4Paged, "layer_first", Build::Ours),
    (V4Paged, "page_first", Build::Ours),
    (V4Paged, "page_first_direct", Build::Ours),
];

/// Every served cell: (kind, layout, io backend, transfer) -> the engine backend it runs on (its
/// copy strategy follows from the layout and backend: [`strategy`]). A cell that is not here is
/// refused with [`refusal`]'s text.
#[rustfmt::skip]
const SERVED: &[(PoolKind, Layout, Io, Transfer, Backend)] = &[
    (Mha, LayerFirst, Io::Kernel, Slots, Backend::Kernel),
    (Mha, LayerFirst, Io::Direct, Slots, Backend::Direct),
    (Mha, PageFirst, Io::Kernel, Slots, Backend::Kernel),
    (Mha, PageFirstDirect, Io::Direct, Slots, Backend::Direct),
    (Mha, PageHead, Io::Kernel, Slots, Backend::Kernel),
    (Mha, PageUnified, Io::Kernel, Slots, Backend::Kernel),
    (AsymmetricMha, PageFirst, Io::Kernel, Slots, Backend::Kernel),
    (AsymmetricMha, PageFirstDirect, Io::Direct, Slots, Backend::Direct),
    (Mla, LayerFirst, Io::Kernel, Slots, Backend::Kernel),
    (Mla, LayerFirst, Io::Direct, Slots, Backend::Direct),
    (Mla, PageFirst, Io::Kernel, Slots, Backend::Kernel),
    (Mla, PageFirstDirect, Io::Direct, Slots, Backend::Direct),
    (Mla, PageUnified, Io::Kernel, Slots, Backend::Kernel),
    (Mla, LayerFirst, Io::Kernel, ShardedBackup, Backend::Kernel),
    (Mla, LayerFirst, Io::Direct, ShardedBackup, Backend::Direct),
    (Mla, PageFirst, Io::Kernel, ShardedBackup, Backend::Kernel),
    (V4Paged, LayerFirst, Io::Kernel, Slots, Backend::Kernel),
    (V4Paged, LayerFirst, Io::Direct, Slots, Backend::Direct),
    (V4Paged, LayerFirst, Io::KernelAscend, Slots, Backend::Direct),
    (V4Paged, PageFirst, Io::Kernel, Slots, Backend::Kernel),
    (V4Paged, PageFirst, Io::KernelAscend, Slots, Backend::Kernel),
    (V4Paged, PageFirstDirect, Io::Direct, Slots, Backend::Direct),
    (V4Paged, PageFirstDirect, Io::KernelAscend, Slots, Backend::Direct),
    (V4Paged, LayerFirst, Io::Kernel, Tokens, Backend::Kernel),
    (V4Paged, LayerFirst, Io::Direct, Tokens, Backend::Direct),
    (V4Paged, LayerFirst, Io::KernelAscend, Tokens, Backend::Direct),
];

/// Layouts not every supported SGLang release builds, with the first release that does.
const INTRODUCED: &[(&str, Release)] = &[("page_unified", (0, 5, 23))];

/// io backends a kind's slot transfers serve only from a release on: before it, SGLang's pool
/// of that kind knows no such backend and refuses it as it refuses any unknown one (V4 paged
/// pools learned kernel_ascend in 0.5.20).
const BACKEND_INTRODUCED: &[(PoolKind, Io, Transfer, Release)] =
    &[(V4Paged, Io::KernelAscend, Slots, (0, 5, 20))];

/// An SGLang release, `(major, minor, patch)`.
pub type Release = (u32, u32, u32);

/// The layout a pool of `kind` is built with, or SGLang's construction refusal. A layout
/// SGLang serves and hostkv_rs does not ([`handed_back`]) is refused here too: only install()'s
/// hand-over reaches SGLang's class for it.
pub fn build(kind: PoolKind, layout: &str) -> Result<Layout> {
    let ours = BUILDS
        .iter()
        .any(|&(k, l, b)| k == kind && l == layout && b == Build::Ours);
    match Layout::parse(layout) {
        Ok(parsed) if ours => Ok(parsed),
        _ => Err(refused_layout(kind, layout)),
    }
}

/// Refuses, as [`build`] refuses a layout it does not know, a layout the SGLang `release` a
/// caller follows does not have yet (None: the newest release).
pub fn check_release(kind: PoolKind, layout: &str, release: Option<Release>) -> Result<()> {
    match (release, INTRODUCED.iter().find(|&&(l, _)| l == layout)) {
        (Some(release), Some(&(_, first))) if release < first => Err(refused_layout(kind, layout)),
        _ => Ok(()),
    }
}

pub(crate) fn refused_layout(kind: PoolKind, layout: &str) -> Error {
    if kind == AsymmetricMha {
        return Error::unsupported(format!(
            "Unsupported layout for models with head_dim != v_head_dim: {layout}; expected \
             'page_first' or 'page_first_direct'."
        ));
    }
    Error::unsupported(format!("Unsupported layout: {layout}"))
}

/// Layouts SGLang's own class of `kind` serves and hostkv_rs does not.
pub fn handed_back(kind: PoolKind) -> Vec<&'static str> {
    BUILDS
        .iter()
        .filter(|&&(k, _, b)| k == kind && b == Build::HandBack)
        .map(|&(_, l, _)| l)
        .collect()
}

/// The route of a transfer, or SGLang's refusal. `io_backend` is None when the caller passed
/// something that is not a string; `shown` is its text; `pool` names the pool in the texts that
/// name it; `release` is the SGLang release the pool follows (None: the newest).
pub fn route(
    kind: PoolKind,
    layout: Layout,
    io_backend: Option<&str>,
    shown: &str,
    transfer: Transfer,
    pool: &str,
    release: Option<Release>,
) -> Result<Route> {
    let mut io = Io::of(io_backend);
    let too_new = BACKEND_INTRODUCED.iter().any(|&(k, i, t, first)| {
        k == kind && i == io && t == transfer && release.is_some_and(|r| r < first)
    });
    if too_new {
        io = Io::Other;
    }
    let Some(&(.., backend)) = SERVED
        .iter()
        .find(|&&(k, l, i, t, _)| k == kind && l == layout && i == io && t == transfer)
    else {
        return Err(Error::unsupported(refusal(
            kind, layout, io, shown, transfer, pool,
        )));
    };
    Ok(Route {
        backend,
        strategy: strategy(layout, backend)?,
    })
}

/// How a (layout, backend) pair moves bytes, whatever the kind: the kernels address every
/// layout one item at a time (a raw request may pair them with any layout); the copy engine
/// coalesces runs on layer_first and copies whole page blocks on page_first_direct, and refuses
/// (with SGLang's layout text) every other layout.
pub fn strategy(layout: Layout, backend: Backend) -> Result<Strategy> {
    match (backend, layout) {
        (Backend::Kernel, _) => Ok(PerItem),
        (Backend::Direct, LayerFirst) => Ok(Runs),
        (Backend::Direct, PageFirstDirect) => Ok(PageBlocks),
        (Backend::Direct, _) => Err(Error::unsupported(refusal(
            Mha,
            layout,
            Io::Direct,
            "direct",
            Slots,
            "",
        ))),
    }
}

/// Every (layout, io_backend) pair a pool kind builds and moves slots with (the CLI's and the
/// benchmark's matrix), in the table's order.
pub fn served_pairs(kind: PoolKind) -> Vec<(Layout, Backend)> {
    SERVED
        .iter()
        .filter(|&&(k, _, i, t, _)| k == kind && t == Slots && i != Io::KernelAscend)
        .map(|&(_, l, _, _, b)| (l, b))
        .collect()
}

/// SGLang's text for a cell the table does not serve, in the order SGLang checks.
fn refusal(
    kind: PoolKind,
    layout_: Layout,
    io: Io,
    shown: &str,
    transfer: Transfer,
    pool: &str,
) -> String {
    let layout = layout_.name();
    match (transfer, kind) {
        // SGLang has no refusal here: its token copy needs per-layer row pointers, which only
        // layer_first pools have, and fails on a None table in the others.
        (Tokens, _) if layout_ != LayerFirst => format!(
            "Unsupported V4 paged host layout/backend: {layout}/{shown} (single tokens move only \
             in layer_first pools; whole pages of slot_page_size indices move in every layout)"
        ),
        (Tokens, _) => format!("Unsupported V4 paged host layout/backend: {layout}/{shown}"),
        (ShardedBackup, _) => match io {
            Io::Kernel => format!("Layer-sharded HiCache backup does not support layout: {layout}"),
            Io::Direct => format!(
                "Layer-sharded direct HiCache backup only supports layer_first layout, got \
                 {layout}"
            ),
            _ => format!("Layer-sharded HiCache backup does not support IO backend: {shown}"),
        },
        (Slots, AsymmetricMha) => match io {
            Io::Kernel => format!(
                "Unsupported layout for models with head_dim != v_head_dim and \
                 io_backend='kernel': {layout}; expected 'page_first'."
            ),
            Io::Direct => format!(
                "Unsupported layout for models with head_dim != v_head_dim and \
                 io_backend='direct': {layout}; expected 'page_first_direct'."
            ),
            _ => format!(
                "Unsupported IO backend for models with head_dim != v_head_dim: {shown}; \
                 expected 'kernel' or 'direct'."
            ),
        },
        (Slots, V4Paged) if io == Io::KernelAscend => format!(
            "{pool} _host_page_view: kernel_ascend requires \
             layer_first/page_first/page_first_direct layout, got '{layout}'"
        ),
        (Slots, V4Paged) => format!("Unsupported V4 paged host layout/backend: {layout}/{shown}"),
        (Slots, Mha | Mla) => match io {
            Io::Kernel | Io::Direct => format!("Unsupported layout: {layout}"),
            // kernel_ascend needs an Ascend NPU; SGLang checks its layout first (MHA serves it on
            // page_first_direct, MLA only on page_first_kv_split).
            Io::KernelAscend if !(kind == Mha && layout_ == PageFirstDirect) => {
                format!("Unsupported layout: {layout}")
            }
            _ => format!("Unsupported IO backend: {shown}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_before_page_unified_refuse_it_with_their_text() {
        for kind in [Mha, Mla] {
            for release in [(0, 5, 18), (0, 5, 21), (0, 5, 22)] {
                let e = check_release(kind, "page_unified", Some(release)).unwrap_err();
                assert_eq!(e.to_string(), "Unsupported layout: page_unified");
                check_release(kind, "page_first", Some(release)).unwrap();
            }
            for release in [Some((0, 5, 23)), Some((0, 6, 0)), None] {
                check_release(kind, "page_unified", release).unwrap();
            }
        }
    }

    #[test]
    fn v4_slot_copies_take_kernel_ascend_from_0_5_20() {
        for layout in [LayerFirst, PageFirst, PageFirstDirect] {
            let at = |release, transfer| {
                let io = Some("kernel_ascend");
                route(
                    V4Paged,
                    layout,
                    io,
                    "kernel_ascend",
                    transfer,
                    "c4",
                    release,
                )
            };
            for release in [Some((0, 5, 18)), Some((0, 5, 19))] {
                assert_eq!(
                    at(release, Slots).unwrap_err().to_string(),
                    format!(
                        "Unsupported V4 paged host layout/backend: {}/kernel_ascend",
                        layout.name()
                    )
                );
            }
            for release in [Some((0, 5, 20)), Some((0, 5, 23)), None] {
                at(release, Slots).unwrap();
            }
            // SGLang's token copy never read io_backend, in any release.
            if layout == LayerFirst {
                at(Some((0, 5, 18)), Tokens).unwrap();
            }
        }
    }

    const KINDS: [PoolKind; 4] = [Mha, AsymmetricMha, Mla, V4Paged];

    fn io_name(io: Io) -> &'static str {
        match io {
            Io::Kernel => "kernel",
            Io::Direct => "direct",
            Io::KernelAscend => "kernel_ascend",
            Io::Other => "other",
        }
    }

    #[test]
    fn every_served_cell_is_a_built_layout() {
        for &(kind, layout, ..) in SERVED {
            assert_eq!(
                build(kind, layout.name()).unwrap(),
                layout,
                "{kind:?} {layout:?}"
            );
        }
    }

    #[test]
    fn every_served_cell_has_a_strategy() {
        for &(kind, layout, io, transfer, backend) in SERVED {
            let route = route(
                kind,
                layout,
                Some(io_name(io)),
                io_name(io),
                transfer,
                "",
                None,
            )
            .unwrap();
            let want = match (backend, layout) {
                (Backend::Kernel, _) => PerItem,
                (Backend::Direct, LayerFirst) => Runs,
                (Backend::Direct, PageFirstDirect) => PageBlocks,
                other => panic!("{other:?} is served but the copy engine cannot move it"),
            };
            assert_eq!((route.backend, route.strategy), (backend, want));
        }
        let e = super::strategy(PageFirst, Backend::Direct).unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_first");
        let e = super::strategy(PageUnified, Backend::Direct).unwrap_err();
        assert_eq!(e.to_string(), "Unsupported layout: page_unified");
    }

    #[test]
    fn handed_back_layouts_are_refused_by_construction() {
        assert_eq!(handed_back(Mla), ["page_first_kv_split"]);
        for kind in KINDS {
            for layout in handed_back(kind) {
                assert!(build(kind, layout).is_err());
            }
        }
        assert!(handed_back(Mha).is_empty());
    }

    #[test]
    fn refusals_use_sglangs_texts() {
        let r = |k, l, io: Option<&str>, t| {
            route(k, l, io, io.unwrap_or("7"), t, "c4", None)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            r(V4Paged, PageHead, Some("kernel_ascend"), Slots),
            "c4 _host_page_view: kernel_ascend requires layer_first/page_first/page_first_direct \
             layout, got 'page_head'"
        );
        assert_eq!(
            r(Mla, PageFirstDirect, Some("kernel"), ShardedBackup),
            "Layer-sharded HiCache backup does not support layout: page_first_direct"
        );
        assert_eq!(
            r(Mla, LayerFirst, None, ShardedBackup),
            "Layer-sharded HiCache backup does not support IO backend: 7"
        );
        assert_eq!(
            r(V4Paged, PageFirst, Some("kernel"), Tokens),
            "Unsupported V4 paged host layout/backend: page_first/kernel (single tokens move only \
             in layer_first pools; whole pages of slot_page_size indices move in every layout)"
        );
        assert_eq!(
            r(Mha, PageFirstDirect, Some("kernel_ascend"), Slots),
            "Unsupported IO backend: kernel_ascend"
        );
        assert_eq!(
            r(Mla, PageFirstDirect, Some("kernel_ascend"), Slots),
            "Unsupported layout: page_first_direct"
        );
    }

    #[test]
    fn transfer_kinds_parse() {
        assert_eq!(Transfer::parse("tokens").unwrap(), Tokens);
        assert!(Transfer::parse("pages").is_err());
    }
}
