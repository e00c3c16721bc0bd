//! The first program of a confined appliance's unit: it forbids the loop driver's ioctls to
//! itself and everything it starts, then becomes guestfish.
//!
//! The appliance reads the backup through the run's loop device, so QEMU holds a descriptor of
//! it. The loop driver checks no capability for `LOOP_CLR_FD` or `LOOP_CHANGE_FD` (Linux
//! `drivers/block/loop.c`, `lo_ioctl`): any opener could detach the PBS mapping or swap its
//! backing for a file of its own, and the sandbox VM would then boot another disk than the
//! backup. systemd's `SystemCallFilter=` names system calls, not their arguments, so this
//! seccomp filter (installed under the unit's `NoNewPrivileges=yes`, inherited across `fork`
//! and `execve`, never removable) refuses every ioctl of the loop driver with `EPERM`, and
//! leaves every other ioctl (KVM's, the block layer's) alone.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

/// The connector's subcommand that is this launcher: `certistack-connector appliance-exec
/// PROGRAM [ARG]...`.
pub const APPLIANCE_EXEC: &str = "appliance-exec";

/// Every ioctl of the loop driver: `LOOP_SET_FD` (0x4C00) to `LOOP_CONFIGURE` (0x4C0A) and
/// `LOOP_CTL_*` (0x4C80…) are plain numbers of type `'L'` without direction or size bits
/// (`include/uapi/linux/loop.h`), so `command & LOOP_IOCTL_MASK == LOOP_IOCTL_BASE` is
/// exactly them.
pub const LOOP_IOCTL_BASE: u32 = 0x4C00;
pub const LOOP_IOCTL_MASK: u32 = 0xFFFF_FF00;

/// The filter: `ioctl(_, command, _)` with a loop command fails with `EPERM`; every other
/// call is allowed (the unit's own `SystemCallFilter=` still applies). The command is compared
/// as the 32 bits the kernel reads (`unsigned int cmd`), so high bits set in the register do
/// not slip past it.
pub fn loop_ioctl_filter() -> Result<BpfProgram, String> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("no seccomp filter for {}: {e}", std::env::consts::ARCH))?;
    let loop_command = SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(u64::from(LOOP_IOCTL_MASK)),
        u64::from(LOOP_IOCTL_BASE),
    )
    .map_err(|e| e.to_string())?;
    let mut rules = BTreeMap::new();
    for number in ioctl_numbers() {
        rules.insert(
            number,
            vec![SeccompRule::new(vec![loop_command.clone()]).map_err(|e| e.to_string())?],
        );
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| e.to_string())?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// The system call numbers of `ioctl` this filter's architecture answers. On x86_64 the x32
/// ABI's (`__X32_SYSCALL_BIT | 514`, `compat_sys_ioctl`, arch/x86/entry/syscalls/syscall_64.tbl)
/// passes the same architecture check as the native one, so it is filtered too, whether or not
/// the kernel has x32 (the unit's `SystemCallArchitectures=native` refuses it as well).
pub fn ioctl_numbers() -> Vec<i64> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![libc::SYS_ioctl, X32_SYSCALL_BIT | 514]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        vec![libc::SYS_ioctl]
    }
}

/// `__X32_SYSCALL_BIT` (arch/x86/include/uapi/asm/unistd.h).
#[cfg(target_arch = "x86_64")]
pub const X32_SYSCALL_BIT: i64 = 0x4000_0000;

/// Installs [`loop_ioctl_filter`] on this process (and what it starts), then replaces it with
/// `program`; returns only on failure, saying what failed.
pub fn exec_without_loop_ioctls(program: &Path, args: &[OsString]) -> String {
    use std::os::unix::process::CommandExt;
    let filter = match loop_ioctl_filter() {
        Ok(filter) => filter,
        Err(reason) => return format!("cannot build the loop ioctl filter: {reason}"),
    };
    if let Err(error) = seccompiler::apply_filter(&filter) {
        return format!("cannot install the loop ioctl filter: {error}");
    }
    let error = std::process::Command::new(program).args(args).exec();
    format!("cannot execute {}: {error}", program.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_filter_compares_the_x32_ioctl_too() {
        let program = loop_ioctl_filter().unwrap();
        for number in ioctl_numbers() {
            let number = u32::try_from(number).unwrap();
            assert!(
                program.iter().any(|instruction| instruction.k == number),
                "no comparison with system call {number:#x}"
            );
        }
        assert!(ioctl_numbers().contains(&(X32_SYSCALL_BIT | 514)));
    }
}
