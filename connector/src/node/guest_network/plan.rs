//! The recovery itself inside one guestfish session: inspect the guest, survey its network
//! configuration, plan the writes per stack, write them and read back their hashes.

use super::profiles::{
    end_line, firewalld_allow, firewalld_default_zone, ifcfg_disable, ifcfg_fights, ifcfg_profile,
    ifupdown_disable, ifupdown_sources_directory, ifupdown_stanza, netplan_fights, netplan_yaml,
    networkd_fights, networkd_link, networkd_profile, networkmanager_disable,
    networkmanager_fights, networkmanager_keyfile,
};
use super::session::{Session, plain_mountable, plain_path, quote, truthy};
use super::{
    DISABLED_SUFFIX, Evidence, FileChange, MAX_GUEST_FILE_BYTES, MAX_PROFILES, NetworkStack,
    PROFILE_NAME, RecoveryError, SandboxNic, WRITE_CHUNK_BYTES,
};
use certistack_core::untrusted::{MAX_VALUE_CHARS, printable};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::net::IpAddr;

/// The directories whose listings recovery acts on; each is checked for names with control
/// characters, which guestfish's one-path-a-line listings cannot carry.
const CONFIG_DIRECTORIES: [&str; 5] = [
    "/etc/netplan",
    "/etc/NetworkManager/system-connections",
    "/etc/sysconfig/network-scripts",
    "/etc/network/interfaces.d",
    "/etc/systemd/network",
];
/// Answers of the survey before its checks of [`CONFIG_DIRECTORIES`].
const SURVEY_LISTINGS: usize = 15;

/// Whether `stack`'s recovery lists (and may act on) the files of `dir`.
fn stack_reads(stack: NetworkStack, dir: &str) -> bool {
    match stack {
        NetworkStack::Netplan => dir == "/etc/netplan",
        NetworkStack::NetworkManager => {
            dir == "/etc/NetworkManager/system-connections"
                || dir == "/etc/sysconfig/network-scripts"
        }
        NetworkStack::Ifcfg => dir == "/etc/sysconfig/network-scripts",
        NetworkStack::Ifupdown => dir == "/etc/network/interfaces.d",
        NetworkStack::Networkd => dir == "/etc/systemd/network",
    }
}

/// One guest configuration file read during the survey: its bytes exactly, and as text (any
/// invalid UTF-8 replaced) for the decisions.
struct GuestFile {
    path: String,
    bytes: Vec<u8>,
    text: String,
}

/// What the recovery will write: (path, content, mode).
struct Write {
    path: String,
    content: Vec<u8>,
    mode: Option<&'static str>,
    action: &'static str,
}

struct Plan {
    writes: Vec<Write>,
    renames: Vec<(String, String)>,
    firewalld_zone: String,
    notes: Vec<String>,
}

/// Roots of more than one operating system shown in a refusal: a few of them, each escaped
/// and bounded. Inspection names a btrfs root by its subvolume, a name the guest chose.
const SHOWN_ROOTS: usize = 4;

fn shown_roots(roots: &[String]) -> String {
    let mut shown: Vec<String> = roots
        .iter()
        .take(SHOWN_ROOTS)
        .map(|root| format!("\"{}\"", printable(root.as_bytes(), MAX_VALUE_CHARS)))
        .collect();
    if roots.len() > SHOWN_ROOTS {
        shown.push(format!("{} more", roots.len() - SHOWN_ROOTS));
    }
    shown.join(", ")
}

/// The evidence of libguestfs inspection from its answers (type, distro, major and minor
/// version, product name), in the order [`recover`] asks them. Every answer is the guest's
/// word (the product name is its os-release `PRETTY_NAME`): each is escaped and bounded here,
/// before it reaches the journal, the reply or the controller's terminal.
pub(super) fn inspection_evidence(answers: &[String]) -> Evidence {
    let fact = |i: usize| {
        printable(
            answers.get(i).map_or("", |answer| answer.trim()).as_bytes(),
            MAX_VALUE_CHARS,
        )
    };
    Evidence {
        os_type: fact(0),
        distro: fact(1),
        version: format!("{}.{}", fact(2), fact(3)),
        product_name: fact(4),
        ..Evidence::default()
    }
}

/// Recovery inside one guestfish session: inspect, survey, write, read back the hashes.
pub(super) async fn recover(
    session: &mut Session,
    nic: &SandboxNic,
    profile_uuid: &str,
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
) -> Result<Evidence, RecoveryError> {
    let started = session
        .ask_text(&["run".into(), "inspect-os".into()])
        .await?;
    let roots: Vec<String> = started
        .get(1)
        .map(|r| {
            r.lines()
                .map(str::to_owned)
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let root = match roots.as_slice() {
        [] => {
            return Err(RecoveryError::Unrecognized(
                "libguestfs inspection found no operating system on the disk".into(),
            ));
        }
        [root] if plain_mountable(root) => root.clone(),
        [root] => {
            return Err(RecoveryError::Unrecognized(format!(
                "libguestfs inspection named the operating system's root \"{}\", not a plain device name; recovery does not touch it",
                printable(root.as_bytes(), MAX_VALUE_CHARS)
            )));
        }
        more => {
            return Err(RecoveryError::Unrecognized(format!(
                "libguestfs inspection found {} operating systems ({}); recovery cannot tell which one boots",
                more.len(),
                shown_roots(more)
            )));
        }
    };
    let quoted_root = quote(root.as_bytes());
    let facts = session
        .ask_text(&[
            format!("inspect-get-type {quoted_root}"),
            format!("inspect-get-distro {quoted_root}"),
            format!("inspect-get-major-version {quoted_root}"),
            format!("inspect-get-minor-version {quoted_root}"),
            format!("inspect-get-product-name {quoted_root}"),
            format!("inspect-get-mountpoints {quoted_root}"),
        ])
        .await?;
    let mut evidence = inspection_evidence(&facts);
    let inspected = format!(
        "libguestfs inspection: type {}, distro {}, version {}, product \"{}\"",
        evidence.os_type, evidence.distro, evidence.version, evidence.product_name
    );
    if evidence.os_type == "windows" {
        return Err(RecoveryError::Windows(inspected));
    }
    if evidence.os_type != "linux" {
        return Err(RecoveryError::Unrecognized(inspected));
    }
    let mut mounts: Vec<(String, String)> = facts
        .get(5)
        .map_or("", |f| f.trim())
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(mp, dev)| (mp.trim().to_owned(), dev.trim().to_owned()))
        .filter(|(mp, dev)| plain_path(mp) && plain_mountable(dev))
        .collect();
    mounts.sort_by_key(|(mp, _)| mp.len());
    // Read-only until there is something to write: a guest recovery refuses leaves the
    // overlay as it found it (a read-write mount alone updates the superblock).
    // nodev: a device node in the guest (say /dev/zero named as a netplan file) cannot be
    // opened, so a read cannot stream without end into the host's temporary files.
    let mount_command = |options: &str, (mp, dev): &(String, String)| {
        format!(
            "-mount-options {} {} {}",
            quote(options.as_bytes()),
            quote(dev.as_bytes()),
            quote(mp.as_bytes())
        )
    };
    // One at a time, shortest first, each mountpoint resolved (guestfsd's `realpath`, inside
    // the guest's tree as mounted so far) before its filesystem goes there: the appliance's
    // kernel follows a symlink in a mountpoint, and an absolute one resolves against the
    // appliance's own root, outside `/sysroot`. A mountpoint that is or passes through a
    // symlink (or is missing) is not mounted, and the evidence says so.
    let mut mounted: Vec<(String, String)> = Vec::with_capacity(mounts.len());
    for mount in mounts {
        if mount.0 != "/" {
            let resolved = session
                .ask_text(&[format!("-realpath {}", quote(mount.0.as_bytes()))])
                .await?;
            if resolved.first().map(|r| r.trim()) != Some(mount.0.as_str()) {
                evidence.notes.push(format!(
                    "the guest mounts {} on {}, which is or passes through a symlink, or is missing; it was not mounted",
                    mount.1, mount.0
                ));
                continue;
            }
        }
        session
            .ask(&[mount_command("ro,nodev,nosuid,noexec", &mount)])
            .await?;
        mounted.push(mount);
    }
    let mount_commands = |options: &str| -> Vec<String> {
        mounted.iter().map(|m| mount_command(options, m)).collect()
    };

    // The survey: what each stack leaves on disk.
    let survey = session
        .ask_text(
            &[
                "glob-expand /etc/netplan/*.yaml".into(),
                "is-dir /etc/NetworkManager".into(),
                "exists /usr/sbin/NetworkManager".into(),
                "glob-expand /etc/NetworkManager/system-connections/*".into(),
                "glob-expand /etc/sysconfig/network-scripts/ifcfg-*".into(),
                "is-file /etc/network/interfaces".into(),
                "exists /sbin/ifup".into(),
                "exists /usr/sbin/ifup".into(),
                "glob-expand /etc/network/interfaces.d/*".into(),
                "glob-expand /etc/systemd/network/*.network".into(),
                "is-symlink /etc/systemd/system/multi-user.target.wants/systemd-networkd.service"
                    .into(),
                "is-file /etc/firewalld/firewalld.conf".into(),
                "is-dir /usr/lib/firewalld/zones".into(),
                "is-file /etc/nftables.conf".into(),
                "is-file /etc/sysconfig/iptables".into(),
            ]
            .into_iter()
            .chain(CONFIG_DIRECTORIES.iter().map(|dir| {
                format!(
                    "glob-expand {}",
                    quote(format!("{dir}/*[[:cntrl:]]*").as_bytes())
                )
            }))
            .collect::<Vec<String>>(),
        )
        .await?;
    let list = |i: usize| -> Vec<String> {
        survey
            .get(i)
            .map(|a| {
                a.lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let netplan_files = list(0);
    let nm_present = truthy(survey.get(1)) && truthy(survey.get(2));
    let nm_files = list(3);
    let ifcfg_files: Vec<String> = list(4)
        .into_iter()
        .filter(|p| !p.ends_with("/ifcfg-lo") && !p.contains(PROFILE_NAME))
        .collect();
    let ifupdown = truthy(survey.get(5)) && (truthy(survey.get(6)) || truthy(survey.get(7)));
    let interfaces_d = list(8);
    let networkd_files = list(9);
    let networkd_enabled = truthy(survey.get(10));
    let firewalld = truthy(survey.get(11)) || truthy(survey.get(12));
    if truthy(survey.get(13)) || truthy(survey.get(14)) {
        evidence.notes.push(
            "the guest has an nftables or iptables ruleset (/etc/nftables.conf, /etc/sysconfig/iptables); it is reported, not changed: it may drop the probes".into(),
        );
    }

    let stack = if !netplan_files.is_empty() {
        NetworkStack::Netplan
    } else if nm_present {
        NetworkStack::NetworkManager
    } else if !ifcfg_files.is_empty() {
        NetworkStack::Ifcfg
    } else if ifupdown {
        NetworkStack::Ifupdown
    } else if !networkd_files.is_empty() || networkd_enabled {
        NetworkStack::Networkd
    } else {
        return Err(RecoveryError::Unrecognized(format!(
            "{inspected}; no network stack found (netplan, NetworkManager, ifcfg, ifupdown, systemd-networkd)"
        )));
    };
    evidence.network_stack = stack.name().into();
    // guestfish lists one path a line: a name with a line break in it would read as two
    // paths, the first naming another file of the directory. Such a name is never guessed at.
    for (index, dir) in CONFIG_DIRECTORIES.iter().enumerate() {
        let hostile = survey
            .get(SURVEY_LISTINGS + index)
            .map(|a| a.trim_end_matches('\n'))
            .unwrap_or("");
        if !hostile.is_empty() && stack_reads(stack, dir) {
            return Err(RecoveryError::Refused(format!(
                "{inspected}; {} configuration directory {dir} holds a file with a control character (such as a line break) in its name (\"{}\"): recovery lists that directory one name a line and will not guess which file is which",
                stack.name(),
                printable(hostile.as_bytes(), MAX_VALUE_CHARS)
            )));
        }
    }

    // The files that could fight the profile, read once.
    let mut candidates: Vec<String> = match stack {
        NetworkStack::Netplan => netplan_files,
        NetworkStack::NetworkManager => nm_files.into_iter().chain(ifcfg_files).collect(),
        NetworkStack::Ifcfg => ifcfg_files,
        NetworkStack::Ifupdown => std::iter::once("/etc/network/interfaces".to_owned())
            .chain(interfaces_d)
            .collect(),
        NetworkStack::Networkd => networkd_files,
    };
    candidates.retain(|p| !p.contains(PROFILE_NAME) && !p.ends_with(DISABLED_SUFFIX));
    if candidates.len() > MAX_PROFILES {
        evidence.notes.push(format!(
            "{} configuration files found; only the first {MAX_PROFILES} were considered",
            candidates.len()
        ));
        candidates.truncate(MAX_PROFILES);
    }
    let (plain, odd): (Vec<String>, Vec<String>) =
        candidates.into_iter().partition(|p| plain_path(p));
    for path in odd {
        evidence.notes.push(format!(
            "\"{}\" has a name recovery does not hand to guestfish; it was left as it is",
            printable(path.as_bytes(), MAX_VALUE_CHARS)
        ));
    }
    let firewalld_conf = if firewalld {
        Some("/etc/firewalld/firewalld.conf".to_owned())
    } else {
        None
    };
    let mut to_read: Vec<String> = plain;
    to_read.extend(firewalld_conf.iter().cloned());
    let files = read_files(session, &to_read, &mut evidence.notes).await?;

    let mut plan = Plan {
        writes: Vec::new(),
        renames: Vec::new(),
        firewalld_zone: String::new(),
        notes: Vec::new(),
    };
    let profiles: Vec<&GuestFile> = files
        .iter()
        .filter(|f| Some(&f.path) != firewalld_conf.as_ref())
        .collect();
    plan_stack(stack, nic, profile_uuid, &profiles, &mut plan);

    if firewalld {
        let conf = files
            .iter()
            .find(|f| Some(&f.path) == firewalld_conf.as_ref())
            .map(|f| f.text.as_str())
            .unwrap_or("");
        let zone = firewalld_default_zone(conf).map_err(RecoveryError::Tool)?;
        plan_firewalld(session, &zone, probe_source, ports, &mut plan).await?;
    }
    evidence.firewalld_zone = plan.firewalld_zone.clone();
    evidence.notes.append(&mut plan.notes);

    // The writes, then the read-back of what landed.
    let mut commands = vec!["umount-all".to_owned()];
    commands.extend(mount_commands("nodev,nosuid,noexec"));
    for (from, to) in &plan.renames {
        commands.push(format!(
            "mv {} {}",
            quote(from.as_bytes()),
            quote(to.as_bytes())
        ));
    }
    for write in &plan.writes {
        if let Some((dir, _)) = write.path.rsplit_once('/')
            && !dir.is_empty()
        {
            commands.push(format!("mkdir-p {}", quote(dir.as_bytes())));
        }
        // In chunks: one quoted line per command stays under MAX_COMMAND_BYTES.
        let mut chunks = write.content.chunks(WRITE_CHUNK_BYTES);
        commands.push(format!(
            "write {} {}",
            quote(write.path.as_bytes()),
            quote(chunks.next().unwrap_or_default())
        ));
        for chunk in chunks {
            commands.push(format!(
                "write-append {} {}",
                quote(write.path.as_bytes()),
                quote(chunk)
            ));
        }
        if let Some(mode) = write.mode {
            commands.push(format!("chmod {mode} {}", quote(write.path.as_bytes())));
        }
    }
    session.ask(&commands).await?;
    let landed: Vec<&str> = plan
        .renames
        .iter()
        .map(|(_, to)| to.as_str())
        .chain(plan.writes.iter().map(|w| w.path.as_str()))
        .collect();
    let sums = session
        .ask_text(
            &landed
                .iter()
                .map(|p| format!("checksum sha256 {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let sum = |i: usize| sums.get(i).map(|s| s.trim().to_owned()).unwrap_or_default();
    for (i, (from, to)) in plan.renames.iter().enumerate() {
        evidence.files.push(FileChange {
            path: from.clone(),
            action: "disabled",
            sha256: sum(i),
            renamed_to: to.clone(),
        });
    }
    for (i, write) in plan.writes.iter().enumerate() {
        let expected = hex::encode(Sha256::digest(&write.content));
        let got = sum(plan.renames.len() + i);
        if got != expected {
            return Err(RecoveryError::Tool(format!(
                "{} reads back with SHA-256 {got:?}, not the {expected} written",
                write.path
            )));
        }
        evidence.files.push(FileChange {
            path: write.path.clone(),
            action: write.action,
            sha256: got,
            renamed_to: String::new(),
        });
    }
    Ok(evidence)
}

/// Reads `paths` (each at most [`MAX_GUEST_FILE_BYTES`]); a larger or unreadable file is noted.
async fn read_files(
    session: &mut Session,
    paths: &[String],
    notes: &mut Vec<String>,
) -> Result<Vec<GuestFile>, RecoveryError> {
    // Regular files only (a FIFO or device node named like a profile is not read).
    let kinds = session
        .ask_text(
            &paths
                .iter()
                .map(|p| format!("-is-file {} followsymlinks:true", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut files = Vec::new();
    for (path, kind) in paths.iter().zip(&kinds) {
        if kind.trim() == "true" {
            files.push(path.clone());
        } else {
            notes.push(format!(
                "{path} is not a regular file; it was left as it is"
            ));
        }
    }
    let paths = &files;
    let sizes = session
        .ask_text(
            &paths
                .iter()
                .map(|p| format!("-filesize {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut readable = Vec::new();
    for (path, size) in paths.iter().zip(&sizes) {
        match size.trim().parse::<u64>() {
            Ok(size) if size <= MAX_GUEST_FILE_BYTES => readable.push((path.clone(), size)),
            Ok(size) => notes.push(format!(
                "{path} holds {size} bytes, more than {MAX_GUEST_FILE_BYTES}; it was left as it is"
            )),
            Err(_) => notes.push(format!(
                "{path} is not a readable file; it was left as it is"
            )),
        }
    }
    let contents = session
        .ask(
            &readable
                .iter()
                .map(|(p, _)| format!("-cat {}", quote(p.as_bytes())))
                .collect::<Vec<_>>(),
        )
        .await?;
    let mut files = Vec::new();
    for ((path, size), bytes) in readable.into_iter().zip(contents) {
        // guestfish's `cat` ends a file at its first NUL byte: a file that reads back shorter
        // than its size is not text recovery could rewrite without mangling it.
        if bytes.len() as u64 != size {
            notes.push(format!(
                "{path} holds a NUL byte (its {size} bytes read as {} bytes of text); recovery edits text files only, so it was left as it is",
                bytes.len()
            ));
            continue;
        }
        files.push(GuestFile {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            path,
            bytes,
        });
    }
    Ok(files)
}

fn plan_stack(
    stack: NetworkStack,
    nic: &SandboxNic,
    profile_uuid: &str,
    files: &[&GuestFile],
    plan: &mut Plan,
) {
    let new = |path: String, content: String, mode: Option<&'static str>| Write {
        path,
        content: content.into_bytes(),
        mode,
        action: "written",
    };
    let changed = |path: String, content: Vec<u8>, mode: Option<&'static str>| Write {
        path,
        content,
        mode,
        action: "changed",
    };
    match stack {
        NetworkStack::Netplan => {
            for file in files.iter().filter(|f| netplan_fights(&f.text, nic)) {
                plan.renames
                    .push((file.path.clone(), format!("{}{DISABLED_SUFFIX}", file.path)));
            }
            plan.writes.push(new(
                format!("/etc/netplan/99-{PROFILE_NAME}.yaml"),
                netplan_yaml(nic),
                Some("0600"),
            ));
        }
        NetworkStack::Networkd => {
            for file in files.iter().filter(|f| networkd_fights(&f.text, nic)) {
                plan.renames
                    .push((file.path.clone(), format!("{}{DISABLED_SUFFIX}", file.path)));
            }
            plan.writes.push(new(
                format!("/etc/systemd/network/00-{PROFILE_NAME}.network"),
                networkd_profile(nic),
                Some("0644"),
            ));
        }
        NetworkStack::NetworkManager | NetworkStack::Ifcfg => {
            for file in files {
                let name = file.path.rsplit('/').next().unwrap_or("");
                if name.starts_with("ifcfg-") {
                    if ifcfg_fights(&file.text, nic) {
                        plan.writes.push(changed(
                            file.path.clone(),
                            ifcfg_disable(&file.bytes),
                            None,
                        ));
                    }
                } else if networkmanager_fights(&file.text, nic) {
                    plan.writes.push(changed(
                        file.path.clone(),
                        networkmanager_disable(&file.bytes),
                        Some("0600"),
                    ));
                }
            }
            if stack == NetworkStack::NetworkManager {
                plan.writes.push(new(
                    format!("/etc/NetworkManager/system-connections/{PROFILE_NAME}.nmconnection"),
                    networkmanager_keyfile(nic, profile_uuid),
                    Some("0600"),
                ));
            } else {
                plan.writes.push(new(
                    format!("/etc/sysconfig/network-scripts/ifcfg-{PROFILE_NAME}"),
                    ifcfg_profile(nic),
                    Some("0644"),
                ));
            }
        }
        NetworkStack::Ifupdown => {
            for file in files {
                if file.path == "/etc/network/interfaces" {
                    let mut text = ifupdown_disable(&file.bytes);
                    if !ifupdown_sources_directory(&file.text) {
                        let mut base = text.clone().unwrap_or_else(|| file.bytes.clone());
                        end_line(&mut base);
                        base.extend_from_slice(
                            format!("source /etc/network/interfaces.d/{PROFILE_NAME}\n").as_bytes(),
                        );
                        text = Some(base);
                    }
                    if let Some(text) = text {
                        plan.writes
                            .push(changed(file.path.clone(), text, Some("0644")));
                    }
                } else if let Some(text) = ifupdown_disable(&file.bytes) {
                    plan.writes
                        .push(changed(file.path.clone(), text, Some("0644")));
                }
            }
            plan.writes.push(new(
                format!("/etc/systemd/network/10-{PROFILE_NAME}.link"),
                networkd_link(nic),
                Some("0644"),
            ));
            plan.writes.push(new(
                format!("/etc/network/interfaces.d/{PROFILE_NAME}"),
                ifupdown_stanza(nic),
                Some("0644"),
            ));
        }
    }
}

async fn plan_firewalld(
    session: &mut Session,
    zone: &str,
    probe_source: IpAddr,
    ports: &BTreeSet<(u16, &'static str)>,
    plan: &mut Plan,
) -> Result<(), RecoveryError> {
    let own = format!("/etc/firewalld/zones/{zone}.xml");
    let shipped = format!("/usr/lib/firewalld/zones/{zone}.xml");
    if ports.is_empty() {
        plan.notes.push(format!(
            "firewalld's default zone is {zone}; the grant names no probe of the guest address, so no allow rule was added"
        ));
        return Ok(());
    }
    let present = session
        .ask_text(&[
            format!("is-file {}", quote(own.as_bytes())),
            format!("is-file {}", quote(shipped.as_bytes())),
        ])
        .await?;
    let source = if truthy(present.first()) {
        own.clone()
    } else if truthy(present.get(1)) {
        shipped
    } else {
        plan.notes.push(format!(
            "firewalld's default zone {zone} has no zone file ({own}); the guest's firewall was left as it is"
        ));
        return Ok(());
    };
    let mut notes = Vec::new();
    let read = read_files(session, std::slice::from_ref(&source), &mut notes).await?;
    plan.notes.append(&mut notes);
    let Some(file) = read.first() else {
        return Ok(());
    };
    match firewalld_allow(&file.bytes, probe_source, ports) {
        Ok(Some(text)) => {
            plan.writes.push(Write {
                action: if source == own { "changed" } else { "written" },
                path: own,
                content: text,
                mode: Some("0644"),
            });
            plan.firewalld_zone = zone.to_owned();
        }
        Ok(None) => plan.firewalld_zone = zone.to_owned(),
        Err(reason) => plan.notes.push(format!(
            "firewalld zone {zone} ({source}): {reason}; it was left as it is"
        )),
    }
    Ok(())
}
