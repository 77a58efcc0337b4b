"""row model: the model each batch row names, so a multi-pool batch claims the rows of its live pools only

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batch_rows') as batch_op:
        batch_op.add_column(sa.Column('model', sa.String(length=512), nullable=True))
        batch_op.create_index('ix_batch_rows_pending_model', ['batch_id', 'model', 'line'], unique=False, sqlite_where=sa.text("state = 'pending'"), postgresql_where=sa.text("state = 'pending'"))
    # Rows still to run were validated before rows named their model: they take their batch's (a batch of one model;
    # a multi-pool batch's rows are then claimed as its first pool's, and each still goes to the pool it names).
    op.execute(
        "UPDATE batch_rows SET model = (SELECT batches.model FROM batches WHERE batches.id = batch_rows.batch_id) "
        "WHERE state = 'pending'"
    )


def downgrade() -> None:
    with op.batch_alter_table('batch_rows') as batch_op:
        batch_op.drop_index('ix_batch_rows_pending_model', sqlite_where=sa.text("state = 'pending'"), postgresql_where=sa.text("state = 'pending'"))
        batch_op.drop_column('model')
