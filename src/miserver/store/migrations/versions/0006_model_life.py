"""model life: the batch weights pin, checkpoints, catalogue entries

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('weights_revision', sa.String(length=64), nullable=True))
    op.create_table('checkpoints',
    sa.Column('model_id', sa.String(length=512), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('weights_revision', sa.String(length=64), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('bytes >= 0', name=op.f('ck_checkpoints_bytes_nonnegative')),
    sa.PrimaryKeyConstraint('model_id', name=op.f('pk_checkpoints'))
    )
    op.create_table('catalogue_models',
    sa.Column('model_id', sa.String(length=512), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('aliases_json', sa.Text(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('model_id', name=op.f('pk_catalogue_models'))
    )


def downgrade() -> None:
    op.drop_table('catalogue_models')
    op.drop_table('checkpoints')
    with op.batch_alter_table('batches') as batch_op:
        batch_op.drop_column('weights_revision')
