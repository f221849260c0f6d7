//! The on-disk format. Pure encode and decode; no I/O.
//!
//! A cache file is a superblock (4 KiB) followed by fixed-size slots. A slot is a 4 KiB block
//! header followed by the payload area (a multiple of 4 KiB). All integers are little-endian.
//!
//! Superblock (bytes 0..56 of the first 4 KiB, the rest zero):
//! `magic "KVBMSUP1" | version u32 | reserved u32 | fingerprint u64 | slot payload bytes u64 |
//!  slot count u64 | epoch u64 | checksum u64` (XXH3-64 of bytes 0..48). The epoch is drawn at
//! random when the file is (re)initialised; block headers carry `block_fingerprint(fingerprint,
//! epoch)`, so blocks of a discarded generation of the file never read as data again.
//!
//! Block header (bytes 0..64 of the slot's first 4 KiB):
//! `magic "KVBMBLK1" | version u32 | flags u32 | key u64 | payload length u64 |
//!  payload checksum u64 | generation u64 | fingerprint u64 | header checksum u64`
//! (XXH3-64 of bytes 0..56; the payload checksum is XXH3-64 of the payload's `payload length`
//! bytes), then the block's metadata, opaque to kvbm-disk (kvbm keeps a block's parent hash and
//! tokens there, to announce recovered blocks): `metadata length u32 | reserved u32 |
//! metadata checksum u64 | metadata bytes` from byte 64, at most [`METADATA_BYTES_MAX`] bytes.
//!
//! Invariant: decoding accepts a header only if magic, version and checksum all agree; any other
//! bytes, of any length, decode to a [`FormatError`] and never panic. A block is data only if its
//! header decodes, names the key, layout fingerprint and generation expected, and its payload
//! matches the payload checksum: a torn, stale or foreign block therefore reads as a miss.

use xxhash_rust::xxh3::xxh3_64;

/// Bytes of the superblock and of each block header on disk.
pub const HEADER_BYTES: usize = 4096;
/// Magic of the superblock.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"KVBMSUP1";
/// Magic of a block header.
pub const BLOCK_MAGIC: [u8; 8] = *b"KVBMBLK1";
/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Largest metadata a block header carries.
pub const METADATA_BYTES_MAX: usize = HEADER_BYTES - 80;

const SUPERBLOCK_CHECKED_BYTES: usize = 48;
const BLOCK_CHECKED_BYTES: usize = 56;

/// The file's geometry and the layout it was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Fingerprint of the KV layout the payloads were written with.
    pub fingerprint: u64,
    /// Payload bytes per slot (a multiple of 4 KiB).
    pub slot_payload_bytes: u64,
    /// Slots in the file.
    pub slot_count: u64,
    /// Random identity of this initialisation of the file.
    pub epoch: u64,
}

/// The fingerprint block headers carry: the layout's, bound to the file's epoch.
pub fn block_fingerprint(layout_fingerprint: u64, epoch: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&layout_fingerprint.to_le_bytes());
    bytes[8..].copy_from_slice(&epoch.to_le_bytes());
    xxh3_64(&bytes)
}

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// The block's key (kvbm uses the sequence hash).
    pub key: u64,
    /// Meaningful payload bytes (at most the slot's payload area).
    pub payload_len: u64,
    /// XXH3-64 of the payload's `payload_len` bytes.
    pub payload_checksum: u64,
    /// Write generation: a later write of the slot has a larger one.
    pub generation: u64,
    /// Layout fingerprint (must equal the superblock's).
    pub fingerprint: u64,
}

/// Why bytes are not a valid superblock or header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// All zero: never written.
    #[error("never written")]
    Empty,
    /// Fewer bytes than a header.
    #[error("{0} bytes, shorter than a header")]
    Truncated(usize),
    /// Not our magic.
    #[error("bad magic")]
    BadMagic,
    /// Written by another format version.
    #[error("format version {0} is not {FORMAT_VERSION}")]
    UnsupportedVersion(u32),
    /// The checksum does not match (torn or corrupted).
    #[error("checksum mismatch")]
    BadChecksum,
    /// Metadata longer than a header can carry.
    #[error("{0} bytes of metadata, more than {METADATA_BYTES_MAX}")]
    MetadataTooLong(usize),
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn check_frame(bytes: &[u8], magic: &[u8; 8], checked: usize) -> Result<(), FormatError> {
    if bytes.len() < checked + 8 {
        return Err(FormatError::Truncated(bytes.len()));
    }
    if bytes[..checked + 8].iter().all(|&b| b == 0) {
        return Err(FormatError::Empty);
    }
    if &bytes[..8] != magic {
        return Err(FormatError::BadMagic);
    }
    let version = u32_at(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion(version));
    }
    if xxh3_64(&bytes[..checked]) != u64_at(bytes, checked) {
        return Err(FormatError::BadChecksum);
    }
    Ok(())
}

impl Superblock {
    /// Writes the superblock into the first bytes of `out` (at least 56 bytes; the caller zeroes
    /// the rest of the 4 KiB).
    pub fn encode(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(&SUPERBLOCK_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&0u32.to_le_bytes());
        out[16..24].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[24..32].copy_from_slice(&self.slot_payload_bytes.to_le_bytes());
        out[32..40].copy_from_slice(&self.slot_count.to_le_bytes());
        out[40..48].copy_from_slice(&self.epoch.to_le_bytes());
        let checksum = xxh3_64(&out[..SUPERBLOCK_CHECKED_BYTES]);
        out[48..56].copy_from_slice(&checksum.to_le_bytes());
    }

    /// Reads a superblock; any other bytes give a [`FormatError`].
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        check_frame(bytes, &SUPERBLOCK_MAGIC, SUPERBLOCK_CHECKED_BYTES)?;
        Ok(Self {
            fingerprint: u64_at(bytes, 16),
            slot_payload_bytes: u64_at(bytes, 24),
            slot_count: u64_at(bytes, 32),
            epoch: u64_at(bytes, 40),
        })
    }
}

impl BlockHeader {
    /// Writes the header into the first 64 bytes of `out` (the caller zeroes the rest).
    pub fn encode(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(&BLOCK_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&0u32.to_le_bytes());
        out[16..24].copy_from_slice(&self.key.to_le_bytes());
        out[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        out[32..40].copy_from_slice(&self.payload_checksum.to_le_bytes());
        out[40..48].copy_from_slice(&self.generation.to_le_bytes());
        out[48..56].copy_from_slice(&self.fingerprint.to_le_bytes());
        let checksum = xxh3_64(&out[..BLOCK_CHECKED_BYTES]);
        out[56..64].copy_from_slice(&checksum.to_le_bytes());
    }

    /// Reads a header; any other bytes give a [`FormatError`].
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        check_frame(bytes, &BLOCK_MAGIC, BLOCK_CHECKED_BYTES)?;
        Ok(Self {
            key: u64_at(bytes, 16),
            payload_len: u64_at(bytes, 24),
            payload_checksum: u64_at(bytes, 32),
            generation: u64_at(bytes, 40),
            fingerprint: u64_at(bytes, 48),
        })
    }
}

/// Writes a block's metadata after its header (bytes 64.. of the header area).
pub fn encode_metadata(metadata: &[u8], out: &mut [u8]) -> Result<(), FormatError> {
    if metadata.len() > METADATA_BYTES_MAX {
        return Err(FormatError::MetadataTooLong(metadata.len()));
    }
    out[64..68].copy_from_slice(&(metadata.len() as u32).to_le_bytes());
    out[68..72].copy_from_slice(&0u32.to_le_bytes());
    out[72..80].copy_from_slice(&xxh3_64(metadata).to_le_bytes());
    out[80..80 + metadata.len()].copy_from_slice(metadata);
    Ok(())
}

/// Reads a block's metadata from its header area; damaged metadata is an error, never data.
pub fn decode_metadata(header_area: &[u8]) -> Result<&[u8], FormatError> {
    if header_area.len() < 80 {
        return Err(FormatError::Truncated(header_area.len()));
    }
    let len = u32_at(header_area, 64) as usize;
    if len > METADATA_BYTES_MAX || header_area.len() < 80 + len {
        return Err(FormatError::MetadataTooLong(len));
    }
    let metadata = &header_area[80..80 + len];
    if xxh3_64(metadata) != u64_at(header_area, 72) {
        return Err(FormatError::BadChecksum);
    }
    Ok(metadata)
}

/// The payload checksum the header records.
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// Why a slot's bytes are not the block asked for (each is a miss, never data).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockMismatch {
    /// The header does not decode.
    #[error("header: {0}")]
    Header(#[from] FormatError),
    /// The header names another key.
    #[error("the slot holds another key")]
    OtherKey,
    /// Written for another layout.
    #[error("the slot was written for another layout")]
    ForeignFingerprint,
    /// An older or newer write than expected.
    #[error("the slot holds another generation")]
    StaleGeneration,
    /// The payload length is not the one expected.
    #[error("payload length {0} is not the one expected")]
    Length(u64),
    /// The payload does not match its checksum (torn or corrupted).
    #[error("payload checksum mismatch")]
    PayloadChecksum,
}

/// Checks a slot's header bytes and payload against what the reader expects.
pub fn verify_block(
    header_bytes: &[u8],
    payload: &[u8],
    key: u64,
    fingerprint: u64,
    generation: Option<u64>,
) -> Result<BlockHeader, BlockMismatch> {
    let header = BlockHeader::decode(header_bytes)?;
    if header.key != key {
        return Err(BlockMismatch::OtherKey);
    }
    if header.fingerprint != fingerprint {
        return Err(BlockMismatch::ForeignFingerprint);
    }
    if generation.is_some_and(|g| g != header.generation) {
        return Err(BlockMismatch::StaleGeneration);
    }
    if header.payload_len != payload.len() as u64 {
        return Err(BlockMismatch::Length(header.payload_len));
    }
    if payload_checksum(payload) != header.payload_checksum {
        return Err(BlockMismatch::PayloadChecksum);
    }
    Ok(header)
}
