//! Which device layer serves which host layer: a pool's controller layer ids (target layers, and
//! packed MTP drafts), the host layer each lands in, and the order a backup walks them.
//!
//! Controller layer ids: a target layer is the device pool's local layer id; packed MTP draft `i`
//! comes as `device_layer_num + i` with `is_draft`. Host layers: the owned target layers in order
//! (or where `host_layers` puts them), then the drafts at `target_layer_num + i` (under layer
//! sharding `target_layer_num` may exceed the owned count by one; that host layer stays unused).
//! A "position" is the index of a device layer in the binding's list: owned targets first, then
//! the drafts.

use std::collections::HashMap;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerMap {
    /// controller layer id -> (host layer, position)
    targets: HashMap<i64, (usize, usize)>,
    drafts: HashMap<i64, (usize, usize)>,
    device_layer_num: i64,
    /// Every (host layer, position), by host layer.
    backup_order: Vec<(usize, usize)>,
    host_layer_num: usize,
}

impl LayerMap {
    /// `positions` device layers: the owned target layers `owned_slots` (controller ids), then
    /// one per packed draft. `what` names the device side in refusals.
    pub fn new(
        positions: usize,
        owned_slots: &[i64],
        device_layer_num: i64,
        target_layer_num: usize,
        host_layers: Option<&[usize]>,
        what: &str,
    ) -> Result<Self> {
        let Some(drafts) = positions.checked_sub(owned_slots.len()) else {
            return Err(Error::value(format!(
                "{what}: every plane needs one tensor per owned layer and draft"
            )));
        };
        if owned_slots.len() > target_layer_num {
            return Err(Error::value(format!(
                "{what}: {} owned layers do not fit {target_layer_num} host layers",
                owned_slots.len()
            )));
        }
        // Controller layer ids are SGLang's layer numbers: a negative or repeated one would map
        // two device layers onto one id (the last silently winning) or answer for a layer no
        // model has.
        let mut seen = std::collections::HashSet::with_capacity(owned_slots.len());
        if let Some(bad) = owned_slots.iter().find(|&&s| s < 0 || !seen.insert(s)) {
            return Err(Error::value(format!(
                "{what}: owned layer ids must be distinct and non-negative, got {bad} in \
                 {owned_slots:?}"
            )));
        }
        // Owned target `k` is host layer `k` unless `host_layers` says otherwise (a device pool
        // handed to one call, holding only some of the layers).
        if let Some(h) = host_layers {
            if h.len() != owned_slots.len() || h.iter().any(|&l| l >= target_layer_num) {
                return Err(Error::value(format!(
                    "{what}: host_layers {h:?} must name one host layer below \
                     {target_layer_num} per owned slot ({} slots)",
                    owned_slots.len()
                )));
            }
        }
        let targets: HashMap<i64, (usize, usize)> = owned_slots
            .iter()
            .enumerate()
            .map(|(k, &slot)| (slot, (host_layers.map_or(k, |h| h[k]), k)))
            .collect();
        let drafts: HashMap<i64, (usize, usize)> = (0..drafts)
            .map(|i| {
                (
                    device_layer_num.saturating_add(i as i64),
                    (target_layer_num + i, owned_slots.len() + i),
                )
            })
            .collect();
        let mut backup_order: Vec<(usize, usize)> =
            targets.values().chain(drafts.values()).copied().collect();
        backup_order.sort_unstable();
        backup_order.dedup();
        let host_layer_num = target_layer_num + drafts.len();
        Ok(Self {
            targets,
            drafts,
            device_layer_num,
            backup_order,
            host_layer_num,
        })
    }

    /// `(host layer, position)` of controller layer `id`: None for a target layer this pool
    /// does not hold (SGLang returns without copying); a draft id outside the packed drafts is
    /// refused.
    pub fn lookup(&self, id: i64, is_draft: bool) -> Result<Option<(usize, usize)>> {
        if !is_draft {
            return Ok(self.targets.get(&id).copied());
        }
        match self.drafts.get(&id) {
            Some(&entry) => Ok(Some(entry)),
            None if self.drafts.is_empty() => Err(Error::layer_index(format!(
                "is_draft layer_id {id} is not a packed MTP draft layer: this host pool holds \
                 no drafts"
            ))),
            None => Err(Error::layer_index(format!(
                "is_draft layer_id {id} is not a packed MTP draft layer: this host pool holds \
                 drafts at layer ids [{}, {})",
                self.device_layer_num,
                self.device_layer_num
                    .saturating_add(self.drafts.len() as i64)
            ))),
        }
    }

    /// Every `(host layer, position)` a backup moves, by host layer.
    pub fn backup_order(&self) -> &[(usize, usize)] {
        &self.backup_order
    }

    /// Whether every host layer has exactly one device layer, in order (one all-layer call
    /// then backs up all).
    pub fn complete(&self) -> bool {
        self.backup_order.len() == self.host_layer_num
            && self
                .backup_order
                .iter()
                .enumerate()
                .all(|(i, &(h, _))| h == i)
    }

    pub fn host_layer_num(&self) -> usize {
        self.host_layer_num
    }

    /// `(controller layer id, host layer)` of every owned target layer, by host layer.
    pub fn targets(&self) -> Vec<(i64, usize)> {
        let mut out: Vec<(i64, usize)> = self.targets.iter().map(|(&s, &(h, _))| (s, h)).collect();
        out.sort_unstable_by_key(|&(_, h)| h);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_then_drafts() {
        // 0.5.23 layer sharding: this rank holds device layers 4..6 of a 6-layer model in host
        // layers 0..2, plus two packed drafts.
        let m = LayerMap::new(4, &[4, 5], 6, 2, None, "device pool").unwrap();
        assert_eq!(m.lookup(4, false).unwrap(), Some((0, 0)));
        assert_eq!(m.lookup(5, false).unwrap(), Some((1, 1)));
        assert_eq!(m.lookup(3, false).unwrap(), None);
        assert_eq!(m.lookup(6, true).unwrap(), Some((2, 2)));
        assert_eq!(m.lookup(7, true).unwrap(), Some((3, 3)));
        let e = m.lookup(8, true).unwrap_err();
        assert!(matches!(
            e,
            Error::Arg(crate::error::ArgError::LayerIndex(_))
        ));
        assert!(e.to_string().contains("drafts at layer ids [6, 8)"), "{e}");
        assert_eq!(m.host_layer_num(), 4);
        assert!(m.complete());
        assert_eq!(m.backup_order(), &[(0, 0), (1, 1), (2, 2), (3, 3)]);
        assert_eq!(m.targets(), vec![(4, 0), (5, 1)]);
    }

    #[test]
    fn negative_or_repeated_layer_ids_are_refused() {
        for owned in [&[-1, 5][..], &[3, 3]] {
            let e = LayerMap::new(2, owned, 0, 2, None, "layer map").unwrap_err();
            assert!(
                e.to_string()
                    .contains("owned layer ids must be distinct and non-negative"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_pool_without_drafts_says_so() {
        // A geometry-only pool's map (`_core.LayerMap`): layers 2..4 of the device pool.
        let m = LayerMap::new(2, &[2, 3], 0, 2, None, "layer map").unwrap();
        assert_eq!(m.lookup(3, false).unwrap(), Some((1, 1)));
        assert_eq!(m.lookup(0, false).unwrap(), None);
        let e = m.lookup(0, true).unwrap_err();
        assert!(
            e.to_string().ends_with("this host pool holds no drafts"),
            "{e}"
        );
    }

    #[test]
    fn a_gap_in_the_host_layers_makes_the_map_incomplete() {
        // Sharding: 3 host target layers, only 2 owned; the third host layer has no device layer.
        let m = LayerMap::new(2, &[0, 1], 3, 3, None, "device pool").unwrap();
        assert!(!m.complete());
        let m = LayerMap::new(2, &[0, 1], 2, 3, Some(&[2, 0]), "device pool").unwrap();
        assert_eq!(m.lookup(0, false).unwrap(), Some((2, 0)));
        assert_eq!(m.backup_order(), &[(0, 1), (2, 0)]);
        assert!(!m.complete());
    }

    #[test]
    fn maps_that_do_not_fit_are_refused_by_name() {
        let e = LayerMap::new(1, &[0, 1], 2, 2, None, "device pool").unwrap_err();
        assert!(e
            .to_string()
            .contains("one tensor per owned layer and draft"));
        let e = LayerMap::new(4, &[0, 1, 2, 3], 4, 3, None, "device pool").unwrap_err();
        assert!(e
            .to_string()
            .contains("4 owned layers do not fit 3 host layers"));
        let e = LayerMap::new(2, &[0, 1], 2, 2, Some(&[0, 2]), "buffer").unwrap_err();
        assert!(
            e.to_string().starts_with("buffer: host_layers [0, 2]"),
            "{e}"
        );
        // A draft id past i64 saturates instead of overflowing.
        let m = LayerMap::new(1, &[], i64::MAX, 0, None, "device pool").unwrap();
        assert_eq!(m.lookup(i64::MAX, true).unwrap(), Some((0, 0)));
    }
}
