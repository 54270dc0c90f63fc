//! A small eBPF assembler: just the instructions the option and steering programs use, with
//! labels.
//!
//! Writing the program here instead of in C keeps clang, libbpf headers and an ELF loader off
//! the build (docs/decisions.md); the encoding is the kernel's `struct bpf_insn`
//! (Documentation/bpf/standardization/instruction-set.rst), little-endian.

use std::collections::HashMap;

/// A register, `r0`..`r10`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reg(pub(crate) u8);

pub(crate) const R0: Reg = Reg(0);
pub(crate) const R1: Reg = Reg(1);
pub(crate) const R2: Reg = Reg(2);
pub(crate) const R3: Reg = Reg(3);
pub(crate) const R4: Reg = Reg(4);
pub(crate) const R5: Reg = Reg(5);
pub(crate) const R6: Reg = Reg(6);
pub(crate) const R7: Reg = Reg(7);
pub(crate) const R8: Reg = Reg(8);
/// The read-only frame pointer.
pub(crate) const R10: Reg = Reg(10);

// Instruction classes.
const LD: u8 = 0x00;
const LDX: u8 = 0x01;
const ST: u8 = 0x02;
const STX: u8 = 0x03;
const ALU64: u8 = 0x07;
const JMP: u8 = 0x05;
// Sizes and modes.
const W: u8 = 0x00;
const H: u8 = 0x08;
const B: u8 = 0x10;
const DW: u8 = 0x18;
const IMM: u8 = 0x00;
const MEM: u8 = 0x60;
// Sources.
const K: u8 = 0x00;
const X: u8 = 0x08;
// ALU operations.
const ADD: u8 = 0x00;
const OR: u8 = 0x40;
const AND: u8 = 0x50;
const LSH: u8 = 0x60;
const RSH: u8 = 0x70;
const MOV: u8 = 0xb0;
// Jump operations.
const JA: u8 = 0x00;
const JEQ: u8 = 0x10;
const JNE: u8 = 0x50;
const JGT: u8 = 0x20;
const JLT: u8 = 0xa0;
const JSLT: u8 = 0xc0;
const CALL: u8 = 0x80;
const EXIT: u8 = 0x90;

/// `src_reg` of a 64-bit immediate load that the kernel replaces a map fd in.
const PSEUDO_MAP_FD: u8 = 1;

/// One encoded instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Insn {
    pub(crate) code: u8,
    pub(crate) dst: u8,
    pub(crate) src: u8,
    pub(crate) off: i16,
    pub(crate) imm: i32,
}

impl Insn {
    /// The 8 bytes of `struct bpf_insn` (dst in the low nibble on little-endian hosts).
    pub(crate) fn encode(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.code;
        b[1] = (self.src << 4) | (self.dst & 0x0f);
        b[2..4].copy_from_slice(&self.off.to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b
    }
}

/// A jump whose target is a label resolved by [`Asm::finish`].
struct Fixup {
    at: usize,
    label: String,
}

/// Builds a program; jumps name labels, which may be defined later.
#[derive(Default)]
pub(crate) struct Asm {
    insns: Vec<Insn>,
    labels: HashMap<String, usize>,
    fixups: Vec<Fixup>,
}

/// A label used but never defined, or defined twice.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LabelError(pub(crate) String);

impl Asm {
    fn push(&mut self, code: u8, dst: Reg, src: Reg, off: i16, imm: i32) -> &mut Self {
        self.insns.push(Insn {
            code,
            dst: dst.0,
            src: src.0,
            off,
            imm,
        });
        self
    }

    fn jump(&mut self, code: u8, dst: Reg, src: Reg, imm: i32, label: &str) -> &mut Self {
        self.fixups.push(Fixup {
            at: self.insns.len(),
            label: label.to_owned(),
        });
        self.push(code, dst, src, 0, imm)
    }

    /// Defines `name` as the address of the next instruction.
    pub(crate) fn label(&mut self, name: &str) -> &mut Self {
        if self
            .labels
            .insert(name.to_owned(), self.insns.len())
            .is_some()
        {
            // Reported by finish(): a duplicate would make jumps ambiguous.
            self.fixups.push(Fixup {
                at: usize::MAX,
                label: name.to_owned(),
            });
        }
        self
    }

    /// `dst = src` (64-bit).
    pub(crate) fn mov(&mut self, dst: Reg, src: Reg) -> &mut Self {
        self.push(ALU64 | MOV | X, dst, src, 0, 0)
    }
    /// `dst = imm` (sign-extended to 64 bits).
    pub(crate) fn mov_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | MOV | K, dst, R0, 0, imm)
    }
    /// `dst += imm`.
    pub(crate) fn add_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | ADD | K, dst, R0, 0, imm)
    }
    /// `dst |= imm`.
    pub(crate) fn or_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | OR | K, dst, R0, 0, imm)
    }
    /// `dst |= src`.
    pub(crate) fn or(&mut self, dst: Reg, src: Reg) -> &mut Self {
        self.push(ALU64 | OR | X, dst, src, 0, 0)
    }
    /// `dst <<= imm`.
    pub(crate) fn lsh_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | LSH | K, dst, R0, 0, imm)
    }
    /// `dst >>= imm` (logical).
    pub(crate) fn rsh_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | RSH | K, dst, R0, 0, imm)
    }
    /// `dst &= imm`.
    pub(crate) fn and_imm(&mut self, dst: Reg, imm: i32) -> &mut Self {
        self.push(ALU64 | AND | K, dst, R0, 0, imm)
    }
    /// `dst = imm64` (two instruction slots).
    pub(crate) fn ld_imm64(&mut self, dst: Reg, imm: u64) -> &mut Self {
        self.push(LD | DW | IMM, dst, R0, 0, imm as u32 as i32);
        self.push(0, R0, R0, 0, (imm >> 32) as u32 as i32)
    }
    /// `dst = map` for the map behind file descriptor `fd` (two slots; the kernel patches it).
    pub(crate) fn ld_map_fd(&mut self, dst: Reg, fd: i32) -> &mut Self {
        self.push(LD | DW | IMM, dst, Reg(PSEUDO_MAP_FD), 0, fd);
        self.push(0, R0, R0, 0, 0)
    }
    /// `dst = *(u32 *)(src + off)`.
    pub(crate) fn ldx_w(&mut self, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(LDX | MEM | W, dst, src, off, 0)
    }
    /// `dst = *(u64 *)(src + off)`.
    pub(crate) fn ldx_dw(&mut self, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(LDX | MEM | DW, dst, src, off, 0)
    }
    /// `dst = *(u16 *)(src + off)`.
    pub(crate) fn ldx_h(&mut self, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(LDX | MEM | H, dst, src, off, 0)
    }
    /// `dst = *(u8 *)(src + off)`.
    pub(crate) fn ldx_b(&mut self, dst: Reg, src: Reg, off: i16) -> &mut Self {
        self.push(LDX | MEM | B, dst, src, off, 0)
    }
    /// `*(u16 *)(dst + off) = src`.
    pub(crate) fn stx_h(&mut self, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(STX | MEM | H, dst, src, off, 0)
    }
    /// `*(u32 *)(dst + off) = src`.
    pub(crate) fn stx_w(&mut self, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(STX | MEM | W, dst, src, off, 0)
    }
    /// `*(u64 *)(dst + off) = src`.
    pub(crate) fn stx_dw(&mut self, dst: Reg, off: i16, src: Reg) -> &mut Self {
        self.push(STX | MEM | DW, dst, src, off, 0)
    }
    /// `*(u32 *)(dst + off) = imm`.
    pub(crate) fn st_w(&mut self, dst: Reg, off: i16, imm: i32) -> &mut Self {
        self.push(ST | MEM | W, dst, R0, off, imm)
    }
    /// `if dst == imm goto label`.
    pub(crate) fn jeq_imm(&mut self, dst: Reg, imm: i32, label: &str) -> &mut Self {
        self.jump(JMP | JEQ | K, dst, R0, imm, label)
    }
    /// `if dst != imm goto label`.
    pub(crate) fn jne_imm(&mut self, dst: Reg, imm: i32, label: &str) -> &mut Self {
        self.jump(JMP | JNE | K, dst, R0, imm, label)
    }
    /// `if dst > src goto label` (unsigned).
    pub(crate) fn jgt(&mut self, dst: Reg, src: Reg, label: &str) -> &mut Self {
        self.jump(JMP | JGT | X, dst, src, 0, label)
    }
    /// `if dst < imm goto label` (unsigned).
    pub(crate) fn jlt_imm(&mut self, dst: Reg, imm: i32, label: &str) -> &mut Self {
        self.jump(JMP | JLT | K, dst, R0, imm, label)
    }
    /// `if (s64)dst < imm goto label`.
    pub(crate) fn jslt_imm(&mut self, dst: Reg, imm: i32, label: &str) -> &mut Self {
        self.jump(JMP | JSLT | K, dst, R0, imm, label)
    }
    /// `goto label`.
    pub(crate) fn ja(&mut self, label: &str) -> &mut Self {
        self.jump(JMP | JA, R0, R0, 0, label)
    }
    /// Calls kernel helper number `helper`; arguments in r1..r5, result in r0.
    pub(crate) fn call(&mut self, helper: i32) -> &mut Self {
        self.push(JMP | CALL, R0, R0, 0, helper)
    }
    /// Returns r0.
    pub(crate) fn exit(&mut self) -> &mut Self {
        self.push(JMP | EXIT, R0, R0, 0, 0)
    }

    /// Resolves the jumps and returns the program.
    pub(crate) fn finish(mut self) -> Result<Vec<Insn>, LabelError> {
        for f in &self.fixups {
            if f.at == usize::MAX {
                return Err(LabelError(format!("label {:?} defined twice", f.label)));
            }
            let target = *self
                .labels
                .get(&f.label)
                .ok_or_else(|| LabelError(format!("label {:?} used but not defined", f.label)))?;
            // Offsets count from the instruction after the jump.
            let off = target as i64 - f.at as i64 - 1;
            let off = i16::try_from(off)
                .map_err(|_| LabelError(format!("jump to {:?} out of range", f.label)))?;
            self.insns[f.at].off = off;
        }
        Ok(self.insns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_match_the_kernel_layout() {
        let mut a = Asm::default();
        a.mov(R6, R1) // bf 16 00 00 00 00 00 00
            .ldx_w(R7, R6, 0) // 61 67 00 00 ...
            .ldx_dw(R2, R6, 184) // 79 62 b8 00 ...
            .st_w(R10, -16, 1) // 62 0a f0 ff 01 00 00 00
            .call(107) // 85 00 00 00 6b 00 00 00
            .mov_imm(R0, 1)
            .exit();
        let p = a.finish().unwrap();
        let bytes: Vec<[u8; 8]> = p.iter().map(Insn::encode).collect();
        assert_eq!(bytes[0], [0xbf, 0x16, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes[1], [0x61, 0x67, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes[2], [0x79, 0x62, 0xb8, 0, 0, 0, 0, 0]);
        assert_eq!(bytes[3], [0x62, 0x0a, 0xf0, 0xff, 1, 0, 0, 0]);
        assert_eq!(bytes[4], [0x85, 0, 0, 0, 107, 0, 0, 0]);
        assert_eq!(bytes[5], [0xb7, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(bytes[6], [0x95, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn narrow_loads_stores_shifts_and_jumps() {
        let mut a = Asm::default();
        a.ldx_b(R1, R10, -48) // 71 a1 d0 ff
            .ldx_h(R2, R10, -14) // 69 a2 f2 ff
            .stx_h(R10, -24, R8) // 6b 8a e8 ff
            .lsh_imm(R2, 4) // 67 02 .. 04
            .rsh_imm(R3, 4) // 77 03 .. 04
            .or(R2, R3) // 4f 32
            .jne_imm(R1, 17, "x") // 55 01 off 11
            .jlt_imm(R2, 0x101, "x") // a5 02 off 0x101
            .jgt(R4, R3, "x") // 2d 34 off 0
            .label("x")
            .exit();
        let p: Vec<[u8; 8]> = a.finish().unwrap().iter().map(Insn::encode).collect();
        assert_eq!(p[0], [0x71, 0xa1, 0xd0, 0xff, 0, 0, 0, 0]);
        assert_eq!(p[1], [0x69, 0xa2, 0xf2, 0xff, 0, 0, 0, 0]);
        assert_eq!(p[2], [0x6b, 0x8a, 0xe8, 0xff, 0, 0, 0, 0]);
        assert_eq!(p[3], [0x67, 0x02, 0, 0, 4, 0, 0, 0]);
        assert_eq!(p[4], [0x77, 0x03, 0, 0, 4, 0, 0, 0]);
        assert_eq!(p[5], [0x4f, 0x32, 0, 0, 0, 0, 0, 0]);
        assert_eq!(p[6], [0x55, 0x01, 2, 0, 17, 0, 0, 0]);
        assert_eq!(p[7], [0xa5, 0x02, 1, 0, 0x01, 0x01, 0, 0]);
        assert_eq!(p[8], [0x2d, 0x34, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn map_load_and_imm64_take_two_slots() {
        let mut a = Asm::default();
        a.ld_map_fd(R1, 7).ld_imm64(R2, 0x1122_3344_5566_7788);
        let p = a.finish().unwrap();
        assert_eq!(p.len(), 4);
        assert_eq!(p[0].encode(), [0x18, 0x11, 0, 0, 7, 0, 0, 0]);
        assert_eq!(p[1].encode(), [0; 8]);
        assert_eq!(p[2].encode(), [0x18, 0x02, 0, 0, 0x88, 0x77, 0x66, 0x55]);
        assert_eq!(p[3].encode(), [0, 0, 0, 0, 0x44, 0x33, 0x22, 0x11]);
    }

    #[test]
    fn jumps_resolve_forward_and_backward() {
        let mut a = Asm::default();
        a.label("top")
            .jeq_imm(R1, 3, "end") // 0 -> 3: off 2
            .mov_imm(R0, 0)
            .ja("top") // 2 -> 0: off -3
            .label("end")
            .exit();
        let p = a.finish().unwrap();
        assert_eq!(p[0].off, 2);
        assert_eq!(p[0].imm, 3);
        assert_eq!(p[0].code, 0x15);
        assert_eq!(p[2].off, -3);
        assert_eq!(p[2].code, 0x05);
    }

    #[test]
    fn label_errors_are_reported() {
        let mut a = Asm::default();
        a.ja("nowhere");
        assert!(a.finish().unwrap_err().0.contains("not defined"));
        let mut a = Asm::default();
        a.label("x").label("x").exit();
        assert!(a.finish().unwrap_err().0.contains("twice"));
    }
}
