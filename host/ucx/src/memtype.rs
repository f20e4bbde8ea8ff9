//! Memory types (`ucs_memory_type_t`): which kinds of memory a context can map and move.

use std::fmt;

use ucx_sys as sys;

/// A kind of memory UCX can map (`ucs_memory_type_t`): host, CUDA device, CUDA managed, ...
///
/// A newtype over the C value rather than a Rust enum: a UCX library newer than the headers
/// this crate was built against may report values the headers do not name, and those stay
/// representable (and print as `memory-type-<n>`).
///
/// There is deliberately no `UNKNOWN` constant: its value is `UCS_MEMORY_TYPE_LAST`, which
/// grows with every UCX release that adds a type (5 in UCX 1.13, larger later), so a value
/// compiled in here could name a real type in the library loaded at run time. To let UCX
/// detect the type, use [`MemRegion::register`](crate::MemRegion::register).
#[doc(alias = "ucs_memory_type_t")]
#[derive(Clone, Copy, Eq, Hash, PartialEq)]
pub struct MemoryType(sys::ucs_memory_type_t);

impl MemoryType {
    /// Default system memory (`UCS_MEMORY_TYPE_HOST`).
    pub const HOST: MemoryType = MemoryType(sys::UCS_MEMORY_TYPE_HOST);
    /// NVIDIA CUDA device memory, e.g. from `cuMemAlloc` (`UCS_MEMORY_TYPE_CUDA`).
    pub const CUDA: MemoryType = MemoryType(sys::UCS_MEMORY_TYPE_CUDA);
    /// NVIDIA CUDA managed (unified) memory, from `cuMemAllocManaged`
    /// (`UCS_MEMORY_TYPE_CUDA_MANAGED`).
    pub const CUDA_MANAGED: MemoryType = MemoryType(sys::UCS_MEMORY_TYPE_CUDA_MANAGED);
    /// AMD ROCm device memory (`UCS_MEMORY_TYPE_ROCM`).
    pub const ROCM: MemoryType = MemoryType(sys::UCS_MEMORY_TYPE_ROCM);
    /// AMD ROCm managed system memory (`UCS_MEMORY_TYPE_ROCM_MANAGED`).
    pub const ROCM_MANAGED: MemoryType = MemoryType(sys::UCS_MEMORY_TYPE_ROCM_MANAGED);

    /// The types the headers this crate was built against name, in `ucs_memory_type_t` order.
    const NAMED: [(MemoryType, &'static str); 5] = [
        (MemoryType::HOST, "host"),
        (MemoryType::CUDA, "cuda"),
        (MemoryType::CUDA_MANAGED, "cuda-managed"),
        (MemoryType::ROCM, "rocm"),
        (MemoryType::ROCM_MANAGED, "rocm-managed"),
    ];

    /// The numeric `ucs_memory_type_t` value.
    pub fn raw(self) -> u32 {
        self.0
    }

    /// UCX's short name for the type (as `ucs_memory_type_names` spells it), or `None` for a
    /// value the headers this crate was built against do not name.
    pub fn name(self) -> Option<&'static str> {
        MemoryType::NAMED
            .iter()
            .find(|(t, _)| *t == self)
            .map(|(_, name)| *name)
    }

    /// Whether the host CPU may read and write memory of this type through ordinary pointers.
    ///
    /// Only [`HOST`](MemoryType::HOST) counts here. Managed memory is CPU-accessible too, but
    /// touching it from the host while a device or a NIC works on it has its own rules, so the
    /// safe host accessors of [`MemRegion`](crate::MemRegion) refuse it.
    pub fn is_host(self) -> bool {
        self == MemoryType::HOST
    }

    pub(crate) fn as_raw(self) -> sys::ucs_memory_type_t {
        self.0
    }

    /// The bit of this type in a [`MemoryTypes`] mask, or 0 if it does not fit in 64 bits.
    fn bit(self) -> u64 {
        1u64.checked_shl(self.0).unwrap_or(0)
    }
}

impl fmt::Debug for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryType({self})")
    }
}

impl fmt::Display for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "memory-type-{}", self.0),
        }
    }
}

/// The set of memory types a context supports (`ucp_context_attr_t::memory_types`, a bitmask
/// of `UCS_BIT(ucs_memory_type_t)`), from [`Context::memory_types`](crate::Context::memory_types).
///
/// A context only reports a device memory type when UCX was built with that device's support
/// (`--with-cuda`, `--with-rocm`) *and* its transports loaded at run time; Debian's UCX 1.13.1
/// reports `host` alone.
///
/// `Display` lists the names, comma-separated (`"host, cuda, cuda-managed"`), or `"none"`.
#[derive(Clone, Copy, Eq, Hash, PartialEq)]
pub struct MemoryTypes(u64);

impl MemoryTypes {
    /// A set from a raw `UCS_BIT(ucs_memory_type_t)` mask, as UCX reports it.
    pub fn from_bits(bits: u64) -> MemoryTypes {
        MemoryTypes(bits)
    }

    /// The raw mask.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether `memory_type` is in the set.
    pub fn contains(self, memory_type: MemoryType) -> bool {
        self.0 & memory_type.bit() != 0
    }

    /// Whether CUDA device memory ([`MemoryType::CUDA`]) is in the set, i.e. whether this UCX
    /// can register and move `cuMemAlloc` memory (it was built with `--with-cuda` and its CUDA
    /// transports, `cuda_copy` at least, loaded).
    pub fn contains_cuda(self) -> bool {
        self.contains(MemoryType::CUDA)
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The types in the set, in `ucs_memory_type_t` order.
    pub fn iter(self) -> impl Iterator<Item = MemoryType> {
        (0..u64::BITS)
            .filter(move |bit| self.0 & (1 << bit) != 0)
            .map(MemoryType)
    }
}

impl fmt::Debug for MemoryTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryTypes({self})")
    }
}

impl fmt::Display for MemoryTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        for (i, memory_type) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{memory_type}")?;
        }
        Ok(())
    }
}

impl FromIterator<MemoryType> for MemoryTypes {
    fn from_iter<I: IntoIterator<Item = MemoryType>>(iter: I) -> MemoryTypes {
        MemoryTypes(iter.into_iter().fold(0, |bits, t| bits | t.bit()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_header_order() {
        let raw: Vec<u32> = MemoryType::NAMED.iter().map(|(t, _)| t.raw()).collect();
        assert_eq!(raw, [0, 1, 2, 3, 4]);
        assert_eq!(MemoryType::CUDA.to_string(), "cuda");
        assert_eq!(MemoryType(7).to_string(), "memory-type-7");
        assert_eq!(MemoryType(7).name(), None);
        assert!(MemoryType::HOST.is_host());
        assert!(!MemoryType::CUDA.is_host() && !MemoryType::CUDA_MANAGED.is_host());
    }

    #[test]
    fn mask_membership_and_display() {
        let host = MemoryTypes::from_bits(1);
        assert!(host.contains(MemoryType::HOST));
        assert!(!host.contains_cuda());
        assert_eq!(host.to_string(), "host");

        let gpu: MemoryTypes = [MemoryType::HOST, MemoryType::CUDA, MemoryType::CUDA_MANAGED]
            .into_iter()
            .collect();
        assert_eq!(gpu.bits(), 0b111);
        assert!(gpu.contains_cuda());
        assert_eq!(gpu.to_string(), "host, cuda, cuda-managed");

        // A newer UCX may report types these headers do not name.
        let newer = MemoryTypes::from_bits(1 | 1 << 5);
        assert_eq!(newer.to_string(), "host, memory-type-5");
        assert_eq!(MemoryTypes::from_bits(0).to_string(), "none");
        assert!(!MemoryTypes::from_bits(u64::MAX).contains(MemoryType(64)));
        assert_eq!(MemoryTypes::from_bits(u64::MAX).iter().count(), 64);
    }
}
