// The page of `pointforge serve`: every action is a call to the service's API.
"use strict";

const $ = (id) => document.getElementById(id);
let shown = null;
// The shown case's downloads as [kind, label, address]; each link's id is download-KIND. Another output is one
// more entry in showCase (or, made on request like the print-ready STL, one call to offer()).
let downloads = [];

async function api(path, options = {}) {
  const response = await fetch(path, { credentials: "same-origin", ...options });
  if (response.status === 401 && path !== "/api/session") { signIn(); throw new Error("sign in first"); }
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error((body && body.detail) || response.statusText);
  return body;
}

function signIn() { $("signin").hidden = false; $("main").hidden = true; }

function cell(row, text) { const td = row.insertCell(); td.textContent = text ?? ""; return td; }

function progressOf(job) {
  if (job.status === "done") return "done";
  if (job.status !== "running") return job.status;
  const bar = document.createElement("progress");
  if (job.total > 0) { bar.max = job.total; bar.value = job.done; }
  const span = document.createElement("span");
  span.append(`${job.stage} `, bar);
  return span;
}

function render(jobs) {
  const body = $("cases");
  body.replaceChildren();
  for (const job of jobs) {
    const row = body.insertRow();
    row.className = job.status;
    row.dataset.id = job.id;
    const name = cell(row, "");
    if (job.status === "done") {
      const link = document.createElement("a");
      link.href = "#" + job.id; link.textContent = job.name;
      link.addEventListener("click", () => showCase(job.id));
      name.append(link);
    } else name.textContent = job.name;
    cell(row, job.status);
    const progress = cell(row, "");
    const shownProgress = progressOf(job);
    if (typeof shownProgress === "string") progress.textContent = shownProgress; else progress.append(shownProgress);
    cell(row, job.message);
    const remove = document.createElement("button");
    remove.textContent = "delete"; remove.disabled = job.status === "running";
    remove.addEventListener("click", () => deleteCase(job.id));
    cell(row, "").append(remove);
  }
}

async function refresh() {
  try { render(await api("/api/cases")); } catch (error) { console.warn(error); }
}

async function showCase(id) {
  const job = await api(`/api/cases/${id}`);
  shown = id;
  $("case").hidden = false;
  $("case-title").textContent = job.name;
  const r = job.report || {};
  const agreement = r.agreement || {}, implant = r.implant || {}, mesh = r.mesh || {};
  $("case-summary").textContent =
    `implant ${implant.volume_cm3} cm³; mesh ${mesh.watertight ? "watertight" : "NOT watertight"}; ` +
    `agreement of the proposals in the implant: mean ${agreement.mean_in_implant}, ` +
    `unanimous ${agreement.unanimous_fraction_in_implant}; ${job.seconds} s`;
  const dicom = r.dicom;
  const checks = $("case-checks");
  checks.replaceChildren();
  for (const note of dicom ? dicom.notes : []) {
    const item = document.createElement("li");
    item.textContent = note;
    checks.append(item);
  }
  checks.hidden = !dicom;
  choices(r.proposals || 0);
  $("printable-result").textContent = ""; $("printable-error").textContent = "";
  downloads = [["implant", "implant", `/api/cases/${id}/files/implant`],
               ["uncertainty", "uncertainty", `/api/cases/${id}/files/uncertainty`],
               ["completed_skull", "completed skull", `/api/cases/${id}/files/completed_skull`],
               ["report", "report", `/api/cases/${id}/files/report`]];
  if (dicom) downloads.push(["seg", "DICOM SEG", `/api/cases/${id}/files/seg`],
                            ["stl_dicom", "DICOM STL", `/api/cases/${id}/files/stl_dicom`]);
  showDownloads();
  $("view").src = `/cases/${id}/view.html`;
}

function showDownloads() {
  const links = $("downloads");
  links.replaceChildren();
  for (const [kind, label, href] of downloads) {
    const a = document.createElement("a");
    a.href = href; a.textContent = label; a.id = `download-${kind}`;
    a.setAttribute("download", "");  // saved under the name the service gives it
    links.append(a);
  }
}

function offer(kind, label, href) {
  downloads = [...downloads.filter(([k]) => k !== kind), [kind, label, href]];
  showDownloads();
}

function choices(proposals) {
  const select = $("printable-choice");
  select.replaceChildren(new Option("vote of all proposals", "vote"));
  for (let k = 0; k < proposals; k++) select.append(new Option(`proposal ${k}`, String(k)));
}

async function makePrintable(event) {
  event.preventDefault();
  const id = shown, choice = $("printable-choice").value;
  $("printable-result").textContent = "making the STL…"; $("printable-error").textContent = "";
  $("printable-button").disabled = true;
  try {
    const query = new URLSearchParams({ choice, min_thickness_mm: $("min-thickness").value || "0",
                                        margin_mm: $("margin").value || "0" });
    const made = await api(`/api/cases/${id}/printable?${query}`, { method: "POST" });
    if (id !== shown) return;
    const what = choice === "vote" ? "the vote" : `proposal ${choice}`;
    $("printable-result").textContent =
      `${what}: measured minimum thickness ${made.measured_min_thickness_mm} mm ` +
      `(asked ${made.min_thickness_mm} mm, margin ${made.margin_mm} mm); ` +
      `overlap with the skull ${made.overlap_with_skull_mm3} mm³; ` +
      `${made.watertight ? "watertight" : "NOT watertight"}, ${made.volume_cm3} cm³`;
    const madeAs = `${what}, ${made.min_thickness_mm} mm, margin ${made.margin_mm} mm`;
    offer("stl", `STL (mm): ${madeAs}`, made.download);
    if (made.download_dicom) offer("stl_dicom_printable", `DICOM STL: ${madeAs}`, made.download_dicom);
  } catch (error) {
    $("printable-result").textContent = ""; $("printable-error").textContent = error.message;
  } finally { $("printable-button").disabled = false; }
}

async function deleteCase(id) {
  try {
    await api(`/api/cases/${id}`, { method: "DELETE" });
    if (shown === id) { $("case").hidden = true; shown = null; }
  } catch (error) { $("upload-error").textContent = error.message; }
  refresh();
}

async function upload(event) {
  event.preventDefault();
  const file = $("file").files[0];
  $("upload-error").textContent = "";
  if (!file) { $("upload-error").textContent = "choose a file first"; return; }
  try {
    await api(`/api/cases?name=${encodeURIComponent(file.name)}`, { method: "POST", body: file });
    $("file").value = "";
  } catch (error) { $("upload-error").textContent = error.message; }
  refresh();
}

async function start() {
  $("signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      await api("/api/session", { method: "POST", headers: { "content-type": "application/json" },
                                  body: JSON.stringify({ token: $("token").value }) });
      $("signin").hidden = true; $("main").hidden = false; refresh();
    } catch (error) { $("signin-error").textContent = error.message; }
  });
  $("upload-form").addEventListener("submit", upload);
  $("printable-form").addEventListener("submit", makePrintable);
  setInterval(() => { if (!$("main").hidden) refresh(); }, 1000);
  try { render(await api("/api/cases")); $("main").hidden = false; } catch (error) { console.warn(error); }
}

start();
